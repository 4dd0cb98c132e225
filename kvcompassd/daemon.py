"""What every daemon mode shares: node settings, TLS file layout, the run loop and its signals.

A mode is an object with ``async start()`` (bind listeners, dial peers) and ``async stop()``.
``serve_forever`` installs uvloop, starts the mode, tells systemd ``READY=1`` only once the
listeners are bound, and on SIGTERM/SIGINT says ``STOPPING=1`` and stops it cleanly.
"""

from __future__ import annotations

import asyncio
import os
import signal
from dataclasses import replace
from pathlib import Path
from typing import Awaitable, Callable, Protocol

import structlog

from kvcompassd.certs import TlsFiles
from kvcompassd.core.config import ClusterConfig
from kvcompassd.sdnotify import notify
from kvcompassd.transport import TransportOptions

# A dead peer (SIGKILL, power loss) is noticed after this long without packets; both ends send
# keepalives at an eighth of it. 4 s bounds how long a request waits on a worker that died
# mid-flight.
DAEMON_TRANSPORT = TransportOptions(idle_timeout=4.0)


def daemon_transport(cfg: ClusterConfig) -> TransportOptions:
    """The daemons' transport options, with the cluster's datagram size where it sets one."""
    if cfg.max_datagram_size:
        return replace(DAEMON_TRANSPORT, max_datagram_size=cfg.max_datagram_size)
    return DAEMON_TRANSPORT

log = structlog.get_logger(__name__)


class Mode(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def status(self) -> str: ...


def tls_files(tls_dir: str | os.PathLike[str], node_id: str) -> TlsFiles:
    """The cluster's file layout (as ``kvcompassctl certs`` writes it): ``ca.pem`` beside
    ``<node-id>.pem`` and ``<node-id>.key``."""
    d = Path(tls_dir)
    files = TlsFiles(ca=d / "ca.pem", cert=d / f"{node_id}.pem", key=d / f"{node_id}.key")
    for path in (files.ca, files.cert, files.key):
        if not path.is_file():
            raise FileNotFoundError(f"TLS file {path} is missing (create it with: kvcompassctl certs issue ...)")
    return files


def split_address(address: str, what: str) -> tuple[str, int]:
    """``host:port`` (IPv6 in brackets) -> (host, port)."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"{what}: expected host:port, got {address!r}")
    return host.strip("[]"), int(port)


def install_uvloop() -> None:
    import uvloop

    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())


async def reload_check(config: Path, tls_dir: Path, node_id: str) -> None:
    """SIGHUP: validate the config and certificates on disk. Every new QUIC connection loads
    the certificate files afresh, so a rotated certificate is in use from here on; a config
    change (peers, addresses) needs a restart, which this says."""
    from kvcompassd.certs import load_certificate, peer_identity
    from kvcompassd.core.config import load_config

    notify("RELOADING=1")
    try:
        load_config(config)
        files = tls_files(tls_dir, node_id)
        identity = peer_identity(load_certificate(files.cert))
        log.info("reloaded: certificates re-read for new connections", identity=str(identity),
                 note="config changes take effect on restart")
    except Exception as exc:  # a bad file on disk must not take the running node down
        log.error("reload failed; still running with what was loaded before", error=str(exc))
    notify("READY=1")


async def serve_until_signalled(mode: Mode, *, on_reload: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start ``mode``, report readiness, and run until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    if on_reload is not None:
        loop.add_signal_handler(signal.SIGHUP, lambda: asyncio.ensure_future(on_reload()))
    await mode.start()
    notify(f"READY=1\nSTATUS={mode.status()}")
    log.info("ready", status=mode.status())
    await stop.wait()
    notify("STOPPING=1")
    log.info("stopping")
    await mode.stop()
