"""``kvcompassctl``: inspect a running deployment, and manage the cluster's certificates.

Queries go over the same authenticated QUIC channel the daemons use, with a certificate of
role ``admin``; tables for people by default, ``--json`` for scripts.

    kvcompassctl certs init --dir ca/ --cluster prod          (on the admin machine; ca.key stays there)
    kvcompassctl certs issue --dir ca/ --role edge --id edge-us [--san 10.0.0.5]
    kvcompassctl --config cluster.toml --tls-dir /etc/kvcompass/tls edge-us status
    kvcompassctl ... edge-us holders --text "a prompt" | --tokens-file ids.json
    kvcompassctl ... mnt-0 status

Every error is one line on stderr and a non-zero exit status: 2 for what the command line or
local files got wrong (usage, unknown node, a query the node's role does not answer, a missing
or unreadable config, certificate or tokens file), 1 for what the node or network did
(unreachable, refused the certificate, refused the query). A closed stdout (``| head``) ends
the command quietly with 141, as SIGPIPE ends other Unix tools.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any, NoReturn

from kvcompassd import certs
from kvcompassd.wire import (
    AdminAnswered,
    AdminQueried,
    ErrorReported,
    NodeIdentity,
    Role,
    WireError,
    encode,
)

# What kvcompassctl asks each role, one line each (``--help`` prints these). The nodes answer
# a few more for tools and tests (an edge's ``lookup``, a maintenance unit's ``entries``), with
# arguments the command line does not take; see kvcompassd/inspect.py.
QUERIES: dict[Role, dict[str, str]] = {
    Role.EDGE: {
        "status": "ready or not, shards held, update batches applied, resyncs, and every shard view",
        "views": "each shard view: region group, epoch/seq, slots, entries, memory, bits per entry",
        "levels": "the prefix lengths looked up toward each region, and the lengths registered",
        "queues": "each worker's queue estimate, trend and age, running requests and the price its "
                  "prefill is scored at, whether its agent is sent the region's vector; per remote "
                  "region the selection correction and herd factor",
        "beliefs": "each worker's cache belief b_r (share of claimed reuse it delivered)",
        "holders": "who holds a prompt's prefix, and the best candidates' scores "
                   "(--text or --tokens-file)",
        "migrations": "recent hot-prefix migrations, and what came of local misses of hot families",
    },
    Role.MAINTENANCE: {
        "status": "the shard's epoch/seq, entries and load per region group, subscribed edges, "
                  "reporting workers",
    },
    Role.AGENT: {
        "status": "the worker's engine state, queue estimate, registered keys, and its region's "
                  "queue vector",
    },
}
EDGE_QUERIES = tuple(QUERIES[Role.EDGE])
_ALL_QUERIES = tuple(dict.fromkeys(q for by_role in QUERIES.values() for q in by_role))
_ROLE_NAMES = {Role.EDGE: "an edge", Role.MAINTENANCE: "a maintenance unit", Role.AGENT: "a worker's agent"}

EXIT_FAILED = 1  # the node or the network: unreachable, refused
EXIT_USAGE = 2  # the command line or local files
EXIT_PIPE_CLOSED = 128 + 13  # as a process ended by SIGPIPE
EXIT_INTERRUPTED = 128 + 2  # as a process ended by SIGINT


class CtlError(Exception):
    """One line for stderr, and the exit status it ends the command with."""

    def __init__(self, message: str, status: int = EXIT_FAILED) -> None:
        super().__init__(message)
        self.status = status


class QueryRefused(CtlError, RuntimeError):
    """The node answered, refusing the query (unknown to its role, or bad arguments)."""


class NodeUnreachable(CtlError, ConnectionError):
    """No QUIC connection to the node: nothing answered, or it refused our certificate."""


async def query(cfg, tls_dir: Path, admin_id: str, node_id: str, what: str, args: dict, timeout: float = 10.0) -> dict:
    """Ask one node once; returns the answer's body.

    Raises :class:`CtlError` (unknown node, unusable admin certificate), :class:`NodeUnreachable`
    or :class:`QueryRefused`, each with a one-line reason."""
    _admin_message(what, args)  # a query too big for one message fails here, before dialling
    async with AdminSession(cfg, tls_dir, admin_id, node_id, timeout=timeout) as session:
        return await session.ask(what, args)


def _admin_message(what: str, args: dict) -> AdminQueried:
    try:
        message = AdminQueried(what, args)
        encode(message)  # its size is checked when encoded
    except WireError as exc:  # over the admin message's bounds (a very long --text, say)
        raise CtlError(f"{what}: the query does not fit one admin message: {exc}", EXIT_USAGE) from None
    return message


class AdminSession:
    """One QUIC connection to one node, asked any number of queries, one stream each.

    For a watcher polling a node: a query over an open connection costs one stream, where
    :func:`query` pays a full TLS handshake each time (on a busy host, hundreds of
    milliseconds). Errors are those of :func:`query`."""

    def __init__(self, cfg, tls_dir: Path, admin_id: str, node_id: str, timeout: float = 10.0) -> None:
        self._cfg, self._tls_dir, self._admin_id, self._node_id = cfg, tls_dir, admin_id, node_id
        self._timeout = timeout
        self._node = None
        self._peer = None

    async def __aenter__(self) -> AdminSession:
        from kvcompassd.daemon import split_address, tls_files
        from kvcompassd.transport import QuicNode
        from kvcompassd.transport.base import HandshakeFailed, PeerUnavailable, TransportOptions

        node_id, timeout = self._node_id, self._timeout
        address, role = _address_of(self._cfg, node_id)
        try:
            files = tls_files(self._tls_dir, self._admin_id)
            # The handshake may take longer than our deadline: running out of time is ours to report.
            self._node = QuicNode(NodeIdentity(Role.ADMIN, self._admin_id), files, on_message=lambda *a: None,
                                  options=TransportOptions(handshake_timeout=timeout + 1.0))
        except (OSError, certs.CertError) as exc:
            raise CtlError(f"admin certificate: {exc}", EXIT_USAGE) from None
        try:
            async with asyncio.timeout(timeout):
                self._peer = await self._node.connect(split_address(address, node_id), expected_role=role)
        except TimeoutError:
            await self._close()
            raise NodeUnreachable(f"{node_id}: unreachable: no QUIC handshake with {address} within {timeout:g} s "
                                  "(is the node running, and is UDP to it open?)") from None
        except HandshakeFailed as exc:  # a certificate refused, by the node or by us
            await self._close()
            raise NodeUnreachable(f"{node_id}: TLS handshake failed: {exc}") from None
        except (PeerUnavailable, OSError, ValueError) as exc:  # ValueError: an address we cannot dial
            await self._close()
            raise NodeUnreachable(f"{node_id}: unreachable: {exc}") from None
        except BaseException:
            await self._close()
            raise
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self._close()

    async def _close(self) -> None:
        node, self._node, self._peer = self._node, None, None
        if node is not None:
            await node.close()

    async def ask(self, what: str, args: dict | None = None) -> dict:
        """One query on its own stream; returns the answer's body."""
        from kvcompassd.transport.base import TransportError

        node_id, timeout = self._node_id, self._timeout
        if self._peer is None:
            raise NodeUnreachable(f"{node_id}: the admin session is closed")
        message = _admin_message(what, args or {})
        try:
            async with asyncio.timeout(timeout):
                async with self._peer.open_stream() as exchange:
                    await exchange.send(message)
                    async for reply in exchange:
                        if isinstance(reply, AdminAnswered):
                            body = reply.body
                            if isinstance(body, dict) and set(body) == {"error"}:
                                raise QueryRefused(f"{node_id}: {what}: {body['error']}")
                            return body
                        if isinstance(reply, ErrorReported):
                            raise QueryRefused(f"{node_id}: {what} refused: {reply.code}: {reply.detail}")
        except TimeoutError:
            raise NodeUnreachable(f"{node_id}: connected, but no answer to {what} within {timeout:g} s") from None
        except TransportError as exc:
            raise NodeUnreachable(f"{node_id}: connection lost during {what}: {exc}") from None
        raise QueryRefused(f"{node_id}: closed the exchange without answering {what}")


def _address_of(cfg, node_id: str) -> tuple[str, Role]:
    for e in cfg.edges:
        if e.id == node_id:
            return e.quic, Role.EDGE
    for m in cfg.maintenance:
        if m.id == node_id:
            return m.quic, Role.MAINTENANCE
    for w in cfg.workers:
        if w.id == node_id and w.agent:
            return w.agent, Role.AGENT
    known = [e.id for e in cfg.edges] + [m.id for m in cfg.maintenance] + [w.id for w in cfg.workers if w.agent]
    raise CtlError(f"no node {node_id!r} with a QUIC address in the config (nodes: {', '.join(known)})", EXIT_USAGE)


def _check_applies(cfg, node_id: str, what: str) -> None:
    """Refuse, before dialling, a query the node's role does not answer."""
    _, role = _address_of(cfg, node_id)
    if what not in QUERIES[role]:
        answered_by = [_ROLE_NAMES[r] for r, qs in QUERIES.items() if what in qs]
        raise CtlError(f"{node_id} is {_ROLE_NAMES[role]}, which answers {', '.join(QUERIES[role])}; "
                       f"{what} is asked of {' or '.join(answered_by)}", EXIT_USAGE)


# -- rendering ------------------------------------------------------------------------------------


def table(rows: list[dict], columns: list[str] | None = None) -> str:
    if not rows:
        return "(none)"
    columns = columns or list(rows[0])
    cells = [[_cell(r.get(c)) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    out = ["  ".join(c.ljust(w) for c, w in zip(columns, widths)), "  ".join("-" * w for w in widths)]
    out += ["  ".join(v.ljust(w) for v, w in zip(row, widths)) for row in cells]
    return "\n".join(out)


def _cell(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        text = f"{v:.3f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.3g}"
        return "0" if text == "-0" else text  # a tiny negative trend rounds to 0, not "-0"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def render(what: str, body: dict) -> str:
    if body.get("mode") == "maintenance":
        head = {k: body[k] for k in ("id", "shard", "epoch", "seq", "entries") if k in body}
        parts = [table([head]), "", "tables:", table(body.get("tables", [])), "",
                 f"subscribers: {', '.join(body.get('subscribers', [])) or '(none)'}", "",
                 "update streams (full, and one per edge region: the lengths its edges look up):",
                 table([{"stream": name, **{k: v for k, v in s.items() if k != "tables"}}
                        for name, s in body.get("streams", {}).items()]), "",
                 "workers:", table([{"worker": w, **v} for w, v in body.get("workers", {}).items()])]
        return "\n".join(parts)
    if body.get("mode") == "agent":
        return table([{k: v for k, v in body.items() if k not in ("region_vector", "migrations")}]) + \
            "\n\nregion queue vector:\n" + table([{"worker": w, "queue_ms": q} for w, q in body.get("region_vector", {}).items()])
    if what == "status":
        head = {k: body[k] for k in ("edge", "region", "ready", "shards_ready", "shards", "batches_applied", "resyncs",
                                     "pending_keys") if k in body}
        return table([head]) + "\n\n" + table(body.get("views", []))
    if what == "views":
        return table(body["views"])
    if what == "levels":
        rows = [{"toward": g, "lengths": " ".join(map(str, ls))} for g, ls in body["toward"].items()]
        return f"from region {body['origin']}\n" + table(rows) + f"\n\nregistration lengths: {' '.join(map(str, body['registration']))}"
    if what == "queues":
        herd = body.get("herd_factor", {})
        corrections = [{"region": r, "correction_ms": ms, **({"herd_factor": herd[r]} if r in herd else {})}
                       for r, ms in body.get("correction_ms", {}).items()]
        return table(body["workers"]) + ("\n\nselection correction per remote region:\n" + table(corrections)
                                         if corrections else "")
    if what == "beliefs":
        return table(body["workers"])
    if what == "holders":
        return (f"prompt: {body['prompt_tokens']} tokens   lambda: {body['lambda']:.3f}   chosen: {body['chosen']}\n\nholders:\n"
                + table(body["holders"])
                + ("\n\njust sent there, not yet in the view (pending):\n" + table(body["pending"]) if body.get("pending") else "")
                + "\n\ncandidates (best first):\n" + table(body["candidates"]))
    if what == "migrations":
        return (table(body["migrations"]) + "\n\nlocal misses of hot prefix families, by trigger and outcome:\n"
                + table(body.get("hot_prefix_misses", [])))
    return json.dumps(body, indent=2)


# -- commands ---------------------------------------------------------------------------------------


def _certs(args) -> int:
    try:
        if args.certs_command == "init":
            files = certs.init_ca(args.dir, cluster_name=args.cluster, days=args.days)
            _emit(f"cluster CA written: {files.cert} (key {files.key}, keep it offline)")
        else:
            files = certs.issue(args.ca_dir or args.dir, args.dir, role=args.role, node_id=args.id,
                                sans=tuple(args.san) or ("127.0.0.1", "localhost"), days=args.days)
            _emit(f"issued {args.role} certificate for {args.id}: {files.cert} (key {files.key})")
    except (certs.CertError, OSError) as exc:
        raise CtlError(f"certs: {exc}", EXIT_USAGE) from None
    return 0


MAX_TOKENS_FILE_BYTES = 16 * 1024 * 1024
MAX_QUERY_TOKENS = 200_000  # packed 4 bytes each, within one admin message (1 MiB)


def _tokens_from(path: str) -> bytes:
    """A JSON list of token ids, packed as little-endian uint32 (one value on the wire, however
    long the prompt; the edge reads either form)."""
    try:
        if Path(path).stat().st_size > MAX_TOKENS_FILE_BYTES:
            raise CtlError(f"--tokens-file {path}: larger than {MAX_TOKENS_FILE_BYTES} bytes", EXIT_USAGE)
        tokens = json.loads(Path(path).read_text())
    except OSError as exc:
        raise CtlError(f"--tokens-file {path}: {exc.strerror or exc}", EXIT_USAGE) from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise CtlError(f"--tokens-file {path}: not JSON: {exc}", EXIT_USAGE) from None
    if not isinstance(tokens, list) or not tokens or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 2**32 for t in tokens):
        raise CtlError(f"--tokens-file {path}: expected a non-empty JSON list of token ids (integers in [0, 2^32))",
                       EXIT_USAGE)
    if len(tokens) > MAX_QUERY_TOKENS:
        raise CtlError(f"--tokens-file {path}: {len(tokens)} tokens, more than {MAX_QUERY_TOKENS}", EXIT_USAGE)
    return struct.pack(f"<{len(tokens)}I", *tokens)


def _query(args) -> int:
    from kvcompassd.core.config import ConfigError, load_config

    # The command line first: a bad --timeout is named before any file is read.
    if not (math.isfinite(args.timeout) and args.timeout > 0):
        raise CtlError("--timeout must be a positive number of seconds", EXIT_USAGE)
    try:
        cfg = load_config(args.config)
    except ConfigError as exc:
        raise CtlError(f"--config: {exc}", EXIT_USAGE) from None
    _check_applies(cfg, args.node, args.what)
    qargs: dict[str, Any] = {}
    if args.what == "holders":
        if args.tokens_file:
            qargs["tokens"] = _tokens_from(args.tokens_file)
        elif args.text:
            qargs["text"] = args.text
        else:
            raise CtlError("holders needs a non-empty --text or --tokens-file", EXIT_USAGE)
        if not 1 <= args.top <= 1000:
            raise CtlError("--top must be in [1, 1000]", EXIT_USAGE)
        qargs["top"] = args.top
    elif args.text is not None or args.tokens_file is not None:
        raise CtlError(f"--text and --tokens-file go with holders, not {args.what}", EXIT_USAGE)
    body = asyncio.run(query(cfg, args.tls_dir, args.admin_id, args.node, args.what, qargs, args.timeout))
    return _emit(json.dumps(body, indent=2, default=str) if args.json else render(args.what, body))


def _emit(text: str) -> int:
    sys.stdout.write(text + "\n")
    sys.stdout.flush()
    return 0


def _queries_help() -> str:
    width = max(len(q) for qs in QUERIES.values() for q in qs)
    blocks = []
    for role, by_name in QUERIES.items():
        node = "its id" + (", the worker's id" if role is Role.AGENT else "")
        blocks.append("\n".join([f"queries of {_ROLE_NAMES[role]} (NODE = {node}):",
                                  *(f"  {name.ljust(width)}  {line}" for name, line in by_name.items())]))
    return "\n\n".join(blocks)


_EPILOG = """exit status: 0 answered; 1 the node or network failed (unreachable, certificate refused,
query refused); 2 a usage or local-file error (unknown node, query not for that node's role,
bad --config, --tls-dir/--admin-id or --tokens-file); 141 stdout closed early (| head)."""


class _Parser(argparse.ArgumentParser):
    """Usage errors as one line on stderr (the usage itself is in --help)."""

    def error(self, message: str) -> NoReturn:
        raise CtlError(f"{message} (see kvcompassctl --help)", EXIT_USAGE)


def build_parser() -> argparse.ArgumentParser:
    usage = ("kvcompassctl --config FILE --tls-dir DIR [--admin-id ID] [--json] [--timeout S] NODE [QUERY] "
             "[--text T | --tokens-file F] [--top N]\n       kvcompassctl certs {init,issue} ...")
    parser = _Parser(prog="kvcompassctl", usage=usage, formatter_class=argparse.RawDescriptionHelpFormatter,
                     description="Ask a running kvcompassd node what it knows (QUERY defaults to status), "
                                 "or manage the cluster's certificates.\n\n" + _queries_help(),
                     epilog=_EPILOG)
    # prog: the subcommands' own usage lines start "kvcompassctl certs ...", not with the
    # top-level usage text above.
    sub = parser.add_subparsers(dest="command", required=True, metavar="{query,certs}", parser_class=_Parser,
                                prog="kvcompassctl")

    c = sub.add_parser("certs", help="cluster CA and node certificates")
    csub = c.add_subparsers(dest="certs_command", required=True, metavar="{init,issue}", parser_class=_Parser,
                            prog="kvcompassctl certs")
    ci = csub.add_parser("init", help="create the cluster CA")
    ci.add_argument("--dir", required=True, type=Path)
    ci.add_argument("--cluster", required=True, help="cluster name (in the CA's subject)")
    ci.add_argument("--days", type=int, default=3650)
    cs = csub.add_parser("issue", help="issue (or rotate) a node certificate")
    cs.add_argument("--dir", required=True, type=Path, help="where to write <id>.pem and <id>.key")
    cs.add_argument("--ca-dir", type=Path, default=None, help="CA directory (default: --dir)")
    cs.add_argument("--role", required=True, choices=[r.value for r in Role])
    cs.add_argument("--id", required=True)
    cs.add_argument("--san", action="append", default=[], help="host name or IP the node is reached at")
    cs.add_argument("--days", type=int, default=365)
    c.set_defaults(func=_certs)

    q = sub.add_parser("query", help="ask a running node (the default: kvcompassctl [query] ... NODE QUERY)",
                       formatter_class=argparse.RawDescriptionHelpFormatter, description=_queries_help(),
                       epilog=_EPILOG)
    _query_args(q)
    return parser


def _query_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--config", required=True, type=Path, help="the cluster config (cluster.toml)")
    q.add_argument("--tls-dir", required=True, type=Path, help="holds ca.pem and the admin certificate")
    q.add_argument("--admin-id", default="admin", help="id of the admin certificate in --tls-dir (default: admin)")
    q.add_argument("--json", action="store_true", help="the node's answer as JSON, for scripts")
    q.add_argument("--timeout", type=float, default=10.0, help="seconds to wait for the handshake, then the answer")
    q.add_argument("--log-level", default="critical", help="transport log lines on stderr (default: none)")
    q.add_argument("node", help="node id: an edge, a maintenance unit, or a worker (its agent)")
    q.add_argument("what", metavar="QUERY", nargs="?", default="status", choices=_ALL_QUERIES,
                   help="one of the queries above (default: status)")
    prompt = q.add_mutually_exclusive_group()  # one prompt: --text or --tokens-file, never both
    prompt.add_argument("--text", default=None, help="holders: the prompt text (tokenised by the edge)")
    prompt.add_argument("--tokens-file", default=None, help="holders: a JSON list of token ids")
    q.add_argument("--top", type=int, default=5, help="holders: how many candidates to show")
    q.set_defaults(func=_query)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in ("certs", "query", "-h", "--help"):
        argv = ["query", *argv]  # the common case needs no subcommand
    try:
        args = build_parser().parse_args(argv)
        if args.command == "query":
            # Answers go to stdout (often into a pipe); errors are ours to report, one line each.
            from kvcompassd.logs import configure_logging

            try:
                configure_logging(args.log_level, json=False)
            except ValueError as exc:
                raise CtlError(f"--log-level: {exc}", EXIT_USAGE) from None
            logging.getLogger("quic").setLevel(max(logging.WARNING, logging.getLogger().level))
        return args.func(args)
    except CtlError as exc:
        # One line, whatever a node put in its reason.
        print("kvcompassctl: " + " ".join(str(exc).split()), file=sys.stderr)
        return exc.status
    except BrokenPipeError:
        # The reader went away (| head): nothing left to say, and nowhere to say it. Point
        # stdout at /dev/null so the interpreter's final flush does not fail again.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return EXIT_PIPE_CLOSED
    except KeyboardInterrupt:
        return EXIT_INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
