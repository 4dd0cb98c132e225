"""aioquic's private fields are read in one module only, and only with the aioquic version that
module was checked against."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

from kvcompassd.transport import aioquic_tweaks

ROOT = Path(__file__).resolve().parents[1]
# aioquic's private QuicConnection/stream/recovery attributes kvcompass has ever read (on
# anything but ``self``: the project's own classes have private fields of the same names).
PRIVATE = re.compile(r"_quic\._\w|(?<!self)\.(_streams|_loss|_spaces|_max_datagram_size|_buffer_start|_buffer_stop|"
                     r"_handshake_complete|_ping_pending|_pacer|_request_client_certificate)\b")


def test_the_installed_and_the_required_aioquic_are_the_checked_one():
    assert version("aioquic") in aioquic_tweaks.CHECKED_AIOQUIC
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    [pin] = [d for d in deps if d.startswith("aioquic")]
    assert pin.replace(" ", "") in {f"aioquic=={v}" for v in aioquic_tweaks.CHECKED_AIOQUIC}


def test_no_module_but_aioquic_tweaks_reads_aioquic_private_fields():
    tweaks = Path(aioquic_tweaks.__file__).resolve()
    offenders = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
                 for folder in ("kvcompassd", "tools")
                 for path in sorted((ROOT / folder).rglob("*.py")) if path.resolve() != tweaks
                 for n, line in enumerate(path.read_text().splitlines(), 1) if PRIVATE.search(line)]
    assert offenders == []
    assert PRIVATE.search(tweaks.read_text())  # the pattern does see the accesses where they are
