"""``kvcompassctl``: inspect a running deployment, and manage the cluster's certificates.

Queries go over the same authenticated QUIC channel the daemons use, with a certificate of
role ``admin``; tables for people by default, ``--json`` for scripts.

    kvcompassctl certs init --dir /etc/kvcompass/tls --cluster prod
    kvcompassctl certs issue --dir /etc/kvcompass/tls --role edge --id edge-us [--san 10.0.0.5]
    kvcompassctl --config cluster.toml --tls-dir /etc/kvcompass/tls edge-us status
    kvcompassctl ... edge-us holders --text "a prompt" | --tokens-file ids.json
    kvcompassctl ... mnt-0 status
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from kvcompassd import certs
from kvcompassd.wire import AdminAnswered, AdminQueried, ErrorReported, NodeIdentity, Role

EDGE_QUERIES = ("status", "views", "levels", "queues", "beliefs", "holders", "migrations")


async def query(cfg, tls_dir: Path, admin_id: str, node_id: str, what: str, args: dict, timeout: float = 10.0) -> dict:
    """Ask one node; returns the answer's body (raises RuntimeError on refusal)."""
    from kvcompassd.daemon import split_address, tls_files
    from kvcompassd.transport import QuicNode

    address, role = _address_of(cfg, node_id)
    node = QuicNode(NodeIdentity(Role.ADMIN, admin_id), tls_files(tls_dir, admin_id), on_message=lambda *a: None)
    try:
        peer = await asyncio.wait_for(node.connect(split_address(address, node_id), expected_role=role), timeout)
        async with peer.open_stream() as exchange:
            await exchange.send(AdminQueried(what, args))
            async with asyncio.timeout(timeout):
                async for reply in exchange:
                    if isinstance(reply, AdminAnswered):
                        return reply.body
                    if isinstance(reply, ErrorReported):
                        raise RuntimeError(f"{node_id} refused: {reply.code}: {reply.detail}")
        raise RuntimeError(f"{node_id} closed the exchange without an answer")
    finally:
        await node.close()


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
    raise SystemExit(f"kvcompassctl: no node {node_id!r} with a QUIC address in the config")


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
        return f"{v:.3f}".rstrip("0").rstrip(".") if abs(v) < 1e6 else f"{v:.3g}"
    if isinstance(v, (list, dict)):
        return json.dumps(v, separators=(",", ":"))
    return str(v)


def render(what: str, body: dict) -> str:
    if "error" in body and len(body) == 1:
        return f"error: {body['error']}"
    if body.get("mode") == "maintenance":
        head = {k: body[k] for k in ("id", "shard", "epoch", "seq", "entries") if k in body}
        parts = [table([head]), "", "tables:", table(body.get("tables", [])), "",
                 f"subscribers: {', '.join(body.get('subscribers', [])) or '(none)'}",
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
            print(f"cluster CA written: {files.cert} (key {files.key}, keep it offline)")
        else:
            files = certs.issue(args.ca_dir or args.dir, args.dir, role=args.role, node_id=args.id,
                                sans=tuple(args.san) or ("127.0.0.1", "localhost"), days=args.days)
            print(f"issued {args.role} certificate for {args.id}: {files.cert} (key {files.key})")
    except certs.CertError as exc:
        print(f"kvcompassctl certs: {exc}", file=sys.stderr)
        return 2
    return 0


def _query(args) -> int:
    from kvcompassd.core.config import load_config

    cfg = load_config(args.config)
    qargs: dict[str, Any] = {}
    if args.what == "holders":
        if args.tokens_file:
            qargs["tokens"] = json.loads(Path(args.tokens_file).read_text())
        elif args.text is not None:
            qargs["text"] = args.text
        else:
            print("kvcompassctl: holders needs --text or --tokens-file", file=sys.stderr)
            return 2
        qargs["top"] = args.top
    try:
        body = asyncio.run(query(cfg, args.tls_dir, args.admin_id, args.node, args.what, qargs, args.timeout))
    except (RuntimeError, TimeoutError, ConnectionError, OSError) as exc:
        print(f"kvcompassctl: {args.node}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(body, indent=2, default=str) if args.json else render(args.what, body))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompassctl", description="inspect kvcompassd nodes; manage certificates")
    sub = parser.add_subparsers(dest="command", required=True)

    c = sub.add_parser("certs", help="cluster CA and node certificates")
    csub = c.add_subparsers(dest="certs_command", required=True)
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

    q = sub.add_parser("query", help="ask a running node (also the default: kvcompassctl NODE WHAT)")
    _query_args(q)
    return parser


def _query_args(q: argparse.ArgumentParser) -> None:
    q.add_argument("--config", required=True, type=Path)
    q.add_argument("--tls-dir", required=True, type=Path)
    q.add_argument("--admin-id", default="admin", help="id of the admin certificate in --tls-dir")
    q.add_argument("--json", action="store_true")
    q.add_argument("--timeout", type=float, default=10.0)
    q.add_argument("node", help="node id: an edge, a maintenance unit, or a worker (its agent)")
    q.add_argument("what", nargs="?", default="status", choices=EDGE_QUERIES)
    q.add_argument("--text", default=None, help="holders: the prompt text (tokenised by the edge)")
    q.add_argument("--tokens-file", default=None, help="holders: JSON list of token ids")
    q.add_argument("--top", type=int, default=5)
    q.set_defaults(func=_query)


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] not in ("certs", "query", "-h", "--help"):
        argv = ["query", *argv]
    args = build_parser().parse_args(argv)
    # Answers go to stdout (often into a pipe); transport chatter only to stderr, warnings up.
    from kvcompassd.logs import configure_logging

    configure_logging("warning", json=False)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
