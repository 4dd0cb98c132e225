"""What every daemon mode shares: node settings, TLS file layout, the run loop and its signals.

A mode is an object with ``async start()`` (bind listeners, dial peers) and ``async stop()``.
``serve_until_signalled`` starts the mode, tells systemd ``READY=1`` only once the listeners
are bound, on SIGHUP runs the reload (``reload_tls``: certificate rotation), and on
SIGTERM/SIGINT says ``STOPPING=1`` and stops it cleanly.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import time
from collections.abc import Awaitable, Callable
from dataclasses import replace
from pathlib import Path
from typing import Protocol

import structlog

from kvcompassd.certs import TlsFiles
from kvcompassd.core.config import ClusterConfig
from kvcompassd.sdnotify import notify
from kvcompassd.transport import QuicNode, TransportOptions

# A dead peer (SIGKILL, power loss) is noticed after this long without packets; an end checks
# every eighth of it and PINGs after three eighths (1.5 s) of quiet, or again at each check while
# its last PING drew no answer (TransportOptions). 4 s bounds how long a request waits on a
# worker that died mid-flight.
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


async def reload_tls(config: Path, node: QuicNode) -> None:
    """SIGHUP (``systemctl reload``): re-read this node's certificate, key and CA bundle; every
    connection made from now on, dialled or accepted, uses them, while established connections
    carry on with theirs. The config is re-validated too, but a config change (peers, addresses)
    needs a restart, which the log line says. Files that do not fit together (a half-copied
    rotation) are refused with an error line and the node keeps what it had."""
    from kvcompassd.core.config import ConfigError, load_config

    notify(f"RELOADING=1\nMONOTONIC_USEC={time.clock_gettime_ns(time.CLOCK_MONOTONIC) // 1000}")
    try:
        certificate = node.reload_tls()
        log.info("reloaded: new connections use the certificate and CA bundle on disk",
                 certificate_serial=f"{certificate.serial_number:x}")
    except (OSError, ValueError) as exc:  # CertError included: a bad file must not stop the node
        log.error("reload failed; still running with the certificates loaded before", error=str(exc))
    try:
        load_config(config)
        log.info("config on disk is valid", note="config changes take effect on restart")
    except ConfigError as exc:
        log.error("config on disk is invalid; a restart would fail", error=str(exc))
    notify("READY=1")


async def serve_until_signalled(mode: Mode, *, on_reload: Callable[[], Awaitable[None]] | None = None) -> None:
    """Start ``mode``, report readiness, and run until SIGTERM/SIGINT."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    reloads: set[asyncio.Task[None]] = set()  # kept: the loop holds tasks weakly

    def start_reload() -> None:
        task = loop.create_task(on_reload())
        reloads.add(task)
        task.add_done_callback(reloads.discard)

    if on_reload is not None:
        loop.add_signal_handler(signal.SIGHUP, start_reload)
    await mode.start()
    # What start-up built (modules, config, connections, views) lives as long as the process:
    # frozen, the collector's full passes no longer walk it (the edge's request path, by
    # callgrind: 0.9 % fewer instructions a request). Its cyclic garbage is collected first.
    gc.collect()
    gc.freeze()
    notify(f"READY=1\nSTATUS={mode.status()}")
    log.info("ready", status=mode.status())
    await stop.wait()
    notify("STOPPING=1")
    log.info("stopping")
    for task in reloads:  # a reload still running would touch a node being closed
        task.cancel()
    await asyncio.gather(*reloads, return_exceptions=True)
    await mode.stop()
