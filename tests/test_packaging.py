"""The source distribution builds the C core: it carries every file the cffi build reads.

setuptools puts only the extension's listed ``.c`` sources in an sdist; the headers they include
and ``ludo_c/build_ludo.py`` (which ``setup.py`` runs) come from MANIFEST.in. Without them
``pip install kvcompassd-*.tar.gz`` fails on any machine, as it did until MANIFEST.in existed.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SDIST_FROM = {"pyproject.toml", "setup.py", "MANIFEST.in", "README.md", "kvcompassd", "ludo_c"}


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True)
    return out.stdout.split()


def test_the_sdist_carries_every_source_header_and_the_build_script_of_the_c_core(tmp_path):
    tree = tmp_path / "tree"
    for name in _tracked():  # a clean copy of what the sdist is built from: no build products
        if name.split("/")[0] in SDIST_FROM and (ROOT / name).is_file():
            (tree / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, tree / name)
    out = tmp_path / "dist"
    subprocess.run([sys.executable, "-c", f"from setuptools import build_meta; build_meta.build_sdist({str(out)!r})"],
                   cwd=tree, check=True, capture_output=True)
    (sdist,) = out.glob("*.tar.gz")
    with tarfile.open(sdist) as tar:
        shipped = {name.split("/", 1)[1] for name in tar.getnames() if "/" in name}

    c_core = sorted(name for name in _tracked() if name.startswith("ludo_c/"))
    assert c_core and set(c_core) <= shipped, sorted(set(c_core) - shipped)
    included = {f"ludo_c/{name}" for path in c_core if path.endswith((".c", ".h"))
                for name in re.findall(r'#include "([^"]+)"', (ROOT / path).read_text())}
    assert included <= shipped, sorted(included - shipped)
    assert {"setup.py", "pyproject.toml", "README.md"} <= shipped
