"""``kvcompassd``: one program, one mode per host (edge, maintenance, agent), plus the emulated
worker, the local demo and the simulator.

Config is loaded and validated before any socket opens; logging is configured once here.
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

from kvcompassd.logs import configure_logging


def _node_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", required=True, type=Path, help="cluster config (TOML)")
    p.add_argument("--id", required=True, help="this node's id in the config (and in its certificate)")
    p.add_argument("--tls-dir", required=True, type=Path, help="directory with ca.pem, <id>.pem, <id>.key")
    p.add_argument("--metrics", default=None,
                   help="host:port for the Prometheus endpoint (default: the node's metrics address in the config, else off)")
    _log_args(p)


def _log_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--log-level", default="info")
    p.add_argument("--log-json", action=argparse.BooleanOptionalAction, default=None,
                   help="JSON log lines (default: when stderr is not a terminal)")


def _load(args):
    from kvcompassd.core.config import load_config
    from kvcompassd.daemon import tls_files

    cfg = load_config(args.config)
    return cfg, tls_files(args.tls_dir, args.id)


def _lookup(items, node_id: str, what: str):
    for item in items:
        if item.id == node_id:
            return item
    raise SystemExit(f"kvcompassd: no {what} with id {node_id!r} in the config")


def _metrics_address(args, cfg, entry, field: str = "metrics") -> str | None:
    """``--metrics`` if given (checked against the config's sockets on this host), else the
    node's entry in the config."""
    if args.metrics is None:
        return getattr(entry, field)
    from kvcompassd.core.config import check_socket_collisions

    check_socket_collisions(cfg, {entry.id: {field: args.metrics}})
    return args.metrics


class _WithMetrics:
    """Start a mode, then its metrics endpoint, before readiness is reported."""

    def __init__(self, mode, metrics_address):
        self.mode, self.metrics_address = mode, metrics_address

    async def start(self):
        from kvcompassd.metrics import start_metrics_server

        await self.mode.start()
        start_metrics_server(self.metrics_address, self.mode.metrics.registry)

    async def stop(self):
        await self.mode.stop()

    def status(self):
        return self.mode.status()


def _serve(mode, metrics_address, args=None) -> int:
    from kvcompassd.daemon import install_uvloop, reload_tls, serve_until_signalled

    install_uvloop()
    on_reload = (lambda: reload_tls(args.config, mode.node)) if args is not None else None
    asyncio.run(serve_until_signalled(_WithMetrics(mode, metrics_address), on_reload=on_reload))
    return 0


def cmd_maintenance(args) -> int:
    cfg, tls = _load(args)
    from kvcompassd.maintenance import MaintenanceNode

    me = _lookup(cfg.maintenance, args.id, "maintenance unit")
    return _serve(MaintenanceNode(cfg, me, tls), _metrics_address(args, cfg, me), args)


def cmd_edge(args) -> int:
    cfg, tls = _load(args)
    from dataclasses import replace

    from kvcompassd.core.ablation import Ablation
    from kvcompassd.edge import EdgeNode
    from kvcompassd.frontdoor import FrontDoorSettings
    from kvcompassd.httplimits import with_overrides
    from kvcompassd.tokenizer import load_tokenizer

    cfg = replace(cfg, frontdoor=with_overrides(cfg.frontdoor, args.frontdoor_limit))
    me = _lookup(cfg.edges, args.id, "edge")
    keys = frozenset(k.strip() for k in Path(args.api_keys_file).read_text().split() if k.strip()) if args.api_keys_file else frozenset()
    ablation = Ablation(cross_region=not args.no_cross_region)
    common = dict(tokenizer=load_tokenizer(*_edge_tokenizer(cfg, args)),
                  frontdoor=FrontDoorSettings(model=cfg.model, max_prompt_tokens=args.max_prompt_tokens, api_keys=keys),
                  local_http=not args.no_local_http, ablation=ablation)
    if getattr(args, "front_door", False):  # `edge-frontdoor`: started by an `edge --workers N`
        import socket

        from kvcompassd.edge_workers import FrontDoorProcess

        control = socket.socket(fileno=args.control_fd)
        node = FrontDoorProcess(cfg, me, tls, view_directory=args.view_directory, control=control,
                                http_address=args.http, **common)
        return _serve(node, None, args)
    from kvcompassd.core.ludo import set_huge_page_views

    set_huge_page_views(not args.no_huge_page_views)  # process-wide: before any view is made
    if args.workers > 1:
        from kvcompassd.edge_workers import MAX_WORKERS, SyncEdgeNode

        if args.workers > MAX_WORKERS:
            raise SystemExit(f"kvcompassd edge: --workers must be at most {MAX_WORKERS}")

        node = SyncEdgeNode(cfg, me, tls, workers=args.workers, front_door_args=_front_door_args(args),
                            copy_from=args.copy_view_from, **common)
    else:
        node = EdgeNode(cfg, me, tls, copy_from=args.copy_view_from, **common)
    return _serve(node, _metrics_address(args, cfg, me), args)


def _front_door_args(args) -> list[str]:
    """The ``edge`` arguments a front-door process of ``--workers N`` takes over."""
    out = ["--config", str(args.config), "--id", args.id, "--tls-dir", str(args.tls_dir),
           "--max-prompt-tokens", str(args.max_prompt_tokens), "--log-level", args.log_level]
    for flag, value in (("--tokenizer", args.tokenizer), ("--chat-template", args.chat_template),
                        ("--api-keys-file", args.api_keys_file)):
        if value is not None:
            out += [flag, str(value)]
    for limit in args.frontdoor_limit:
        out += ["--frontdoor-limit", limit]
    if args.no_local_http:
        out.append("--no-local-http")
    if args.no_cross_region:
        out.append("--no-cross-region")
    if args.log_json is not None:
        out.append("--log-json" if args.log_json else "--no-log-json")
    return out


def _edge_tokenizer(cfg, args) -> tuple[str | None, str | None]:
    """The cluster's [tokenizer] unless --tokenizer overrides it (then --chat-template goes with it)."""
    if args.tokenizer is None:
        return cfg.tokenizer.path, args.chat_template or cfg.tokenizer.chat_template
    return args.tokenizer, args.chat_template


def cmd_agent(args) -> int:
    cfg, tls = _load(args)
    from kvcompassd.agent import AgentNode

    worker = _lookup(cfg.workers, args.id, "worker")
    if not 0 < args.load_poll_ms <= 10_000 or not (args.load_idle_poll_ms is None or
                                                   args.load_poll_ms <= args.load_idle_poll_ms <= 10_000):
        raise SystemExit("kvcompassd agent: need 0 < --load-poll-ms <= --load-idle-poll-ms <= 10000")
    node = AgentNode(cfg, worker, tls, replay_endpoint=args.replay_endpoint,
                     load_interval=args.load_poll_ms / 1000.0,
                     load_idle_interval=None if args.load_idle_poll_ms is None else args.load_idle_poll_ms / 1000.0,
                     chaos_drop_engine_batches=args.chaos_drop_engine_batches)
    return _serve(node, _metrics_address(args, cfg, worker, "agent_metrics"), args)


def cmd_emulate_worker(args) -> int:
    from kvcompassd.core.config import load_config
    from kvcompassd.daemon import install_uvloop, serve_until_signalled
    from kvcompassd.emulator.server import EmulatedWorker, EmulatorSettings

    cfg = load_config(args.config)
    worker = _lookup(cfg.workers, args.id, "worker")
    # The cluster's [tokenizer], as the edges use it (the unit passes no --tokenizer): an
    # emulated worker that tokenised otherwise would be refused by every edge's check.
    tokenizer, chat_template = _edge_tokenizer(cfg, args)
    from kvcompassd.worker.kvtransfer import KvTransferTiming

    roles = {"role": args.role} if args.role else {}
    settings = EmulatorSettings.from_worker_config(
        worker, model=cfg.model, block_size=cfg.index.block_size, time_scale=args.time_scale,
        eviction=args.eviction, seed=args.seed, kv_events_style=args.kv_events_style,
        tokenizer=tokenizer or "byte", chat_template=chat_template,
        kv_transfer=KvTransferTiming.for_worker(cfg, worker),
        transfer_timeout_s=cfg.disaggregation.transfer_timeout_s, **roles)
    install_uvloop()
    asyncio.run(serve_until_signalled(_EmulatedWorkerMode(EmulatedWorker(settings))))
    return 0


class _EmulatedWorkerMode:
    """The emulated worker as a daemon mode: READY=1 once its HTTP and KV-event sockets are
    bound (the unit is Type=notify like the others), STOPPING=1 and a clean stop on SIGTERM."""

    def __init__(self, worker):
        self.worker = worker

    async def start(self):
        await self.worker.start()

    async def stop(self):
        await self.worker.stop()

    def status(self):
        return f"emulated worker {self.worker.settings.worker_id} on {self.worker.http_url}"


def cmd_demo(args) -> int:
    from kvcompassd.demo import main as demo_main

    return demo_main(args)


def cmd_sim(args) -> int:
    from kvcompassd.sim.cli import main as sim_main

    return sim_main(args.sim_args)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvcompassd", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("maintenance", help="own one shard of the index")
    _node_args(p)
    p.set_defaults(func=cmd_maintenance)

    p = sub.add_parser("edge", help="a region's gateway: views, score, HTTP front door")
    _node_args(p)
    p.add_argument("--tokenizer", default=None,
                   help="override the config's [tokenizer] path: a Hugging Face tokenizer directory, or 'byte'")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the tokenizer's)")
    p.add_argument("--max-prompt-tokens", type=int, default=131072)
    p.add_argument("--api-keys-file", default=None, help="file with one accepted API key per line")
    p.add_argument("--frontdoor-limit", action="append", default=[], metavar="NAME=VALUE",
                   help="override a [frontdoor] limit of the config, e.g. header_timeout_s=5 (repeatable)")
    p.add_argument("--no-local-http", action="store_true", help="reach own-region workers over QUIC too")
    p.add_argument("--no-cross-region", action="store_true", help="ablation: never reuse or forward across regions")
    p.add_argument("--copy-view-from", default=None, help="bootstrap the views from this peer edge")
    p.add_argument("--workers", type=_positive_int, default=1, metavar="N",
                   help="N front-door processes on the HTTP port (SO_REUSEPORT) sharing one copy of the views "
                        "in shared memory (Linux); this process syncs the views and is one of them")
    p.add_argument("--no-huge-page-views", action="store_true",
                   help="keep the views on ordinary 4 KiB pages (by default they live on transparent huge pages, "
                        "so that a decision's reads across thousands of views rarely miss the TLB)")
    p.set_defaults(func=cmd_edge)

    p = sub.add_parser("edge-frontdoor", help=argparse.SUPPRESS)  # started by `edge --workers N` only
    _node_args(p)
    p.add_argument("--tokenizer", default=None)
    p.add_argument("--chat-template", default=None)
    p.add_argument("--max-prompt-tokens", type=int, default=131072)
    p.add_argument("--api-keys-file", default=None)
    p.add_argument("--frontdoor-limit", action="append", default=[])
    p.add_argument("--no-local-http", action="store_true")
    p.add_argument("--no-cross-region", action="store_true")
    p.add_argument("--view-directory", required=True)
    p.add_argument("--control-fd", type=int, required=True)
    p.add_argument("--http", required=True)
    p.set_defaults(func=cmd_edge, front_door=True, copy_view_from=None, workers=1)

    p = sub.add_parser("agent", help="beside one inference engine")
    _node_args(p)
    p.add_argument("--replay-endpoint", default=None, help="engine's KV-event replay socket (default: from /server_info)")
    p.add_argument("--chaos-drop-engine-batches", type=float, default=0.0, metavar="P",
                   help="fault injection: drop this share of the engine's live event batches (recovered by replay)")
    p.add_argument("--load-poll-ms", type=float, default=20.0, metavar="MS",
                   help="read the engine's load this often while it works (default 20)")
    p.add_argument("--load-idle-poll-ms", type=float, default=None, metavar="MS",
                   help="back off to this period while the engine sits idle (default: [idle] heartbeat_ms)")
    p.set_defaults(func=cmd_agent)

    p = sub.add_parser("emulate-worker", help="an SGLang-compatible emulated worker (no GPU)")
    p.add_argument("--config", required=True, type=Path)
    p.add_argument("--id", required=True, help="the worker's id in the config")
    p.add_argument("--time-scale", type=float, default=1.0, help="1 = modelled A100 times, 0 = no delays")
    p.add_argument("--eviction", choices=("lru", "lfu"), default="lru")
    p.add_argument("--kv-events-style", choices=("map", "positional"), default="map",
                   help="event encoding: map (SGLang 0.5.23, vLLM) or positional (older SGLang)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--role", choices=("mixed", "prefill", "decode"), default=None,
                   help="override the worker's role in the config: SGLang's --disaggregation-mode (a prefill "
                        "worker listens on the worker's bootstrap_port, SGLang's default 8998 without one)")
    p.add_argument("--tokenizer", default=None,
                   help="override the config's [tokenizer] path (default: it, else 'byte'): a Hugging Face "
                        "tokenizer directory, or 'byte'")
    p.add_argument("--chat-template", default=None, help="Jinja chat template file (default: the tokenizer's)")
    _log_args(p)
    p.set_defaults(func=cmd_emulate_worker, tls_dir=None)

    p = sub.add_parser("demo", help="a local three-region deployment on loopback, with a workload")
    p.add_argument("--requests", type=int, default=240)
    p.add_argument("--concurrency", type=int, default=24)
    p.add_argument("--time-scale", type=float, default=1.0)
    p.add_argument("--wan-scale", type=float, default=1.0, help="multiply the WAN delays")
    p.add_argument("--workdir", type=Path, default=None,
                   help="keep configs, certificates and logs here (a new directory: a run does not overwrite "
                        "another's certificates)")
    p.add_argument("--keep", action="store_true",
                   help="keep the KVCompass deployment running after the table (Ctrl-C or SIGTERM stops it)")
    p.add_argument("--disaggregated", action="store_true",
                   help="prefill-decode disaggregation: per region 2 prefill + 1 decode emulated workers, the edges "
                        "as SGLang's prefill-decode router")
    p.add_argument("--decode-policy", choices=("least_loaded", "random"), default="least_loaded",
                   help="with --disaggregated: how the edge picks the decode worker in the prefill's region")
    _log_args(p)
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("sim", help="the event-driven simulator (see `kvcompassd sim --help`)", add_help=False)
    p.add_argument("sim_args", nargs=argparse.REMAINDER)
    p.set_defaults(func=cmd_sim)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "sim":  # the simulator has its own parser (and its own --help)
        from kvcompassd.sim.cli import main as sim_main

        return sim_main(argv[1:])
    args = build_parser().parse_args(argv)
    if args.command not in ("sim",):
        configure_logging(args.log_level, json=args.log_json, node=getattr(args, "id", None))
    try:
        return args.func(args)
    except (FileNotFoundError, ValueError) as exc:
        print(f"kvcompassd {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
