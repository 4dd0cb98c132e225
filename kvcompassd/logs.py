"""Logging, configured once at the entry point: JSON lines when not on a TTY, console otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


class _CurrentStderr:
    """Writes to whatever ``sys.stderr`` is now: loggers are cached, stderr may be swapped
    (test capture, daemon redirection), and a logger must never hold on to a closed file."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(level: str = "info", *, json: bool | None = None, node: str | None = None) -> None:
    """Route stdlib logging and structlog through one renderer on stderr.

    ``json=None`` picks JSON when stderr is not a TTY (systemd's journal, CI, files), which is
    what log shippers want, and a readable console format for a person at a terminal.
    """
    if json is None:
        json = not sys.stderr.isatty()
    numeric = getattr(logging, level.upper(), None)
    if not isinstance(numeric, int):
        raise ValueError(f"unknown log level {level!r}")
    shared = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if node:
        structlog.contextvars.bind_contextvars(node=node)
    renderer = structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    structlog.configure(
        processors=[*shared, structlog.processors.format_exc_info, renderer],
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),
        cache_logger_on_first_use=True,
    )
    # Libraries (aioquic, aiohttp) log through the stdlib: render them the same way.
    handler = logging.StreamHandler(_CurrentStderr())
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(processor=renderer, foreign_pre_chain=shared)
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(max(numeric, logging.INFO) if numeric < logging.INFO else numeric)
    # aioquic is chatty at INFO about every connection; keep it to warnings.
    logging.getLogger("quic").setLevel(logging.WARNING)
