"""Cluster config: the testbed file, validation errors naming file/table/field, dump round trip."""

from __future__ import annotations

import copy
import math
import tomllib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcompassd.core.config import (
    ClusterConfig,
    ConfigError,
    DeadlineParams,
    IndexParams,
    RegionConfig,
    ScoreParams,
    SGLANG_BOOTSTRAP_PORT,
    WorkerConfig,
    bootstrap_port_of,
    check_socket_collisions,
    config_sockets,
    derive_one_way_ms,
    dump_config,
    load_config,
    parse_config,
)
from kvcompassd.sim.geo import RTX5090_DRAM_KV_TOKENS, RTX5090_VRAM_KV_TOKENS

TESTBED = Path(__file__).resolve().parent.parent / "config" / "testbed-3continent.toml"


def minimal() -> dict:
    return {
        "cluster": {"name": "t", "model": "m", "shards": 2},
        "regions": [{"name": "a"}, {"name": "b"}],
        "links": [{"between": ["a", "b"], "one_way_ms": 40.0}],
        "workers": [
            {"id": "a-0", "region": "a", "prefill_ms_per_token": 0.1, "decode_ms_per_token": 10.0,
             "vram_kv_tokens": 1000, "dram_kv_tokens": 4000},
            {"id": "b-0", "region": "b", "prefill_ms_per_token": 0.2, "decode_ms_per_token": 10.0,
             "vram_kv_tokens": 1000, "dram_kv_tokens": 4000},
        ],
    }


def error_of(data: dict, source: str = "x.toml") -> str:
    with pytest.raises(ConfigError) as info:
        parse_config(data, source)
    return str(info.value)


# ---------------------------------------------------------------- the testbed


def test_testbed_matches_the_paper() -> None:
    cfg = load_config(TESTBED)
    assert cfg.region_names() == ("us", "eu", "asia")
    assert [len(cfg.workers_in(r)) for r in cfg.region_names()] == [8, 2, 4]
    assert cfg.one_way_ms("us", "eu") == 160.0 and cfg.one_way_ms("eu", "us") == 160.0
    assert cfg.one_way_ms("us", "asia") == 126.0
    assert cfg.rtt_ms("eu", "asia") == 298.0
    assert cfg.one_way_ms("eu", "eu") == cfg.intra_region_one_way_ms == 0.25
    for worker in cfg.workers:
        assert worker.prefill_ms_per_token == 0.085
        # RTX 5090s: 12 GiB of KV in VRAM, HiCache's host pool twice that (as the generated
        # North-American testbed, kvcompassd/sim/geo.py)
        assert worker.vram_kv_tokens == 12 * 2**30 // (128 * 2**10) == RTX5090_VRAM_KV_TOKENS == 98304
        assert worker.dram_kv_tokens == 2 * worker.vram_kv_tokens == RTX5090_DRAM_KV_TOKENS
    assert [e.region for e in cfg.edges] == ["us", "eu", "asia"]
    assert sorted(m.shard for m in cfg.maintenance) == [0, 1, 2, 3] and cfg.shards == 4
    assert cfg.score.gamma_ms_per_token == pytest.approx(128 * 1024 / 25e9 * 1e3, rel=1e-3)
    assert cfg.worker("eu-1").region == "eu"
    assert cfg.worker_ids()[:2] == ("us-0", "us-1")
    assert all(not link.derived for link in cfg.links)


def test_testbed_round_trips_through_dump() -> None:
    cfg = load_config(TESTBED)
    assert parse_config(tomllib.loads(dump_config(cfg)), "dump") == cfg


def test_defaults_fill_optional_tables() -> None:
    cfg = parse_config(minimal(), "x")
    assert cfg.index == IndexParams() and cfg.score == ScoreParams()
    assert cfg.tenant == "" and cfg.edges == () and cfg.maintenance == ()


def test_queries_reject_unknown_names() -> None:
    cfg = parse_config(minimal(), "x")
    with pytest.raises(KeyError, match="zz"):
        cfg.one_way_ms("a", "zz")
    with pytest.raises(KeyError, match="nope"):
        cfg.worker("nope")
    with pytest.raises(KeyError):
        cfg.workers_in("zz")


# ---------------------------------------------------------------- errors name file, table and field


def test_unknown_region_names_file_table_and_field(tmp_path: Path) -> None:
    text = TESTBED.read_text().replace('id = "us-2"                    # unique node id (also in its certificate)\n'
                                       'region = "us"', 'id = "us-2"\nregion = "xx"', 1)
    assert 'region = "xx"' in text
    path = tmp_path / "testbed.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value) == f"{path}: [[workers]] #3 field 'region': unknown region 'xx'"
    assert (info.value.table, info.value.field) == ("[[workers]] #3", "region")


@pytest.mark.parametrize(
    ("mutate", "expected"),
    [
        (lambda d: d["cluster"].update(colour="red"), "x.toml: [cluster] field 'colour': unknown field"),
        (lambda d: d.update(extra={}), "x.toml: unknown top-level table 'extra'"),
        (lambda d: d.__setitem__("index", {"block_size": 16, "levelz": 3}), "x.toml: [index] field 'levelz': unknown field"),
        (lambda d: d.__setitem__("index", {"value_bits": 48}), "x.toml: [index] field 'value_bits': must be 32 or 64"),
        (lambda d: d.__setitem__("index", {"same_region_min_tokens": 40}), "[index] field 'same_region_min_tokens': must be a multiple"),
        (lambda d: d.__setitem__("index", {"block_size": True}), "[index] field 'block_size': expected an integer"),
        (lambda d: d.__setitem__("index", {"levels": 6.0}), "[index] field 'levels': expected an integer"),
        (lambda d: d.__setitem__("index", {"max_load": 1.0}), "[index] field 'max_load': must be < 1"),
        (lambda d: d.__setitem__("index", {"context_tokens": 131071}), "[index] field 'context_tokens': must be a multiple"),
        (lambda d: d.__setitem__("index", {"context_tokens": 1 << 25}), "[index] field 'context_tokens': must be <="),
        (lambda d: d.__setitem__("index", {"long_growth": 1.05}), "[index] field 'long_growth': must be >= 1.1"),
        (lambda d: d.__setitem__("index", {"same_region_growth": 1.0}), "[index] field 'same_region_growth'"),
        (lambda d: d.__setitem__("index", {"same_region_growth": 3.0}), "[index] field 'same_region_growth'"),
        (lambda d: d.__setitem__("index", {"same_region_max_step": 1.05}), "[index] field 'same_region_max_step'"),
        (lambda d: d.__setitem__("index", {"same_region_max_step": 2.5}), "[index] field 'same_region_max_step'"),
        (lambda d: d.__setitem__("score", {"wan": "half"}), "[score] field 'wan': must be 'rtt' or 'one_way'"),
        (lambda d: d.__setitem__("score", {"tau_ms": 0}), "[score] field 'tau_ms': must be > 0"),
        (lambda d: d.__setitem__("score", {"queue_ewma_weight": 1.5}), "[score] field 'queue_ewma_weight': must be <= 1"),
        (lambda d: d.__setitem__("score", {"lambda_max": math.nan}), "[score] field 'lambda_max': must be finite"),
        (lambda d: d.__setitem__("score", {"occupancy_ms_per_running": -0.5}), "[score] field 'occupancy_ms_per_running'"),
        (lambda d: d.__setitem__("score", {"pending_hold_ms": -1.0}), "[score] field 'pending_hold_ms'"),
        (lambda d: d.__setitem__("score", {"decode_stall_weight": -0.25}), "[score] field 'decode_stall_weight': must be >= 0"),
        (lambda d: d.__setitem__("score", {"decode_stall_weight": math.inf}), "[score] field 'decode_stall_weight'"),
        (lambda d: d.__setitem__("score", {"copy_pinned_floor": 1.0}), "[score] field 'copy_pinned_floor': must be < 1"),
        (lambda d: d.__setitem__("score", {"copy_pinned_floor": -0.1}), "[score] field 'copy_pinned_floor': must be >= 0"),
        (lambda d: d.__setitem__("deadlines", {"worker_stream_interval": 0}), "[deadlines] field 'worker_stream_interval'"),
        (lambda d: d.__setitem__("deadlines", {"worker_stream_interval": 4097}), "field 'worker_stream_interval': must be <="),
        (lambda d: d.__setitem__("deadlines", {"worker_stream_interval": 16.0}),
         "[deadlines] field 'worker_stream_interval': expected an integer"),
        (lambda d: d.__setitem__("score", {"pending_hold_ms": math.inf}), "[score] field 'pending_hold_ms'"),
        (lambda d: d["cluster"].pop("model"), "x.toml: [cluster] field 'model': missing required field"),
        (lambda d: d["cluster"].update(shards=0), "[cluster] field 'shards': must be >= 1"),
        (lambda d: d["cluster"].update(max_datagram_size=600), "[cluster] field 'max_datagram_size': must be 0 (by path)"),
        (lambda d: d["cluster"].update(max_datagram_size=70000), "[cluster] field 'max_datagram_size': must be <= 65527"),
        (lambda d: d["workers"][1].pop("prefill_ms_per_token"), "[[workers]] #2 field 'prefill_ms_per_token': missing"),
        (lambda d: d["workers"][1].update(prefill_ms_per_token=0), "[[workers]] #2 field 'prefill_ms_per_token': must be > 0"),
        (lambda d: d["workers"][0].update(vram_kv_tokens=-1), "[[workers]] #1 field 'vram_kv_tokens': must be >= 0"),
        (lambda d: d["workers"][0].update(http="127.0.0.1:1"), "[[workers]] #1 field 'http': expected a http/https://"),
        (lambda d: d["workers"][0].update(agent="localhost"), "[[workers]] #1 field 'agent': expected host:port"),
        (lambda d: d["workers"][1].update(id="a-0"), "[[workers]] #2 field 'id': duplicate id 'a-0'"),
        (lambda d: d.__setitem__("workers", []), "[[workers]]: at least one worker is required"),
        (lambda d: d["regions"].append({"name": "a"}), "[[regions]] #3 field 'name': duplicate region 'a'"),
        (lambda d: d["regions"][0].update(latitude=10.0), "[[regions]] #1 field 'longitude': latitude and longitude go together"),
        (lambda d: d["regions"][0].update(latitude=91.0, longitude=0.0), "[[regions]] #1 field 'latitude': must be <= 90"),
        (lambda d: d.__setitem__("links", []), "[[links]] field 'between': no link between 'a' and 'b'"),
        (lambda d: d["links"].append({"between": ["b", "a"], "one_way_ms": 40.0}), "[[links]] #2 field 'between': duplicate link"),
        (lambda d: d["links"][0].update(one_way_ms=-1.0), "[[links]] #1 field 'one_way_ms': must be >= 0"),
        (lambda d: d["links"][0].update(between=["a", "a"]), "[[links]] #1 field 'between': a link joins two different regions"),
        (lambda d: d["links"][0].update(between=["a", "c"]), "[[links]] #1 field 'between': unknown region 'c'"),
        (lambda d: d["links"][0].update(derived=True), "[[links]] #1 field 'derived': unknown field"),
        (lambda d: d.__setitem__("edges", [{"id": "a-0", "region": "a"}]), "[[edges]] #1 field 'id': duplicate id 'a-0'"),
        (lambda d: d.__setitem__("edges", [{"id": "e", "region": "q"}]), "[[edges]] #1 field 'region': unknown region 'q'"),
        (lambda d: d.__setitem__("maintenance", [{"id": "m0", "shard": 0}]), "[[maintenance]] field 'shard': shards [1] have no maintenance unit"),
        (lambda d: d.__setitem__("maintenance", [{"id": "m0", "shard": 0}, {"id": "m1", "shard": 0}]),
         "[[maintenance]] #2 field 'shard': shard 0 already owned by [[maintenance]] #1"),
        (lambda d: d.__setitem__("maintenance", [{"id": "m0", "shard": 0}, {"id": "m1", "shard": 2}]),
         "[[maintenance]] #2 field 'shard': shard 2 out of range 0..1"),
        (lambda d: d.__setitem__("workers", {"id": "x"}), "x.toml: [[workers]]: expected an array of tables"),
    ],
)
def test_errors_name_file_table_and_field(mutate, expected: str) -> None:
    data = copy.deepcopy(minimal())
    mutate(data)
    message = error_of(data)
    assert message.startswith("x.toml: ")
    assert expected in message


def test_errors_are_value_errors_and_report_syntax(tmp_path: Path) -> None:
    path = tmp_path / "bad.toml"
    path.write_text("[cluster\nname = 1\n")
    with pytest.raises(ValueError, match=r"bad\.toml: invalid TOML"):
        load_config(path)
    with pytest.raises(ConfigError, match=r"missing\.toml: cannot read"):
        load_config(tmp_path / "missing.toml")


def test_direct_construction_is_validated() -> None:
    worker = WorkerConfig("w", "nowhere", 0.1, 10.0, 1, 1)
    with pytest.raises(ConfigError, match=r"\[\[workers\]\] #1 field 'region': unknown region 'nowhere'"):
        ClusterConfig(name="c", model="m", regions=(RegionConfig("a"),), workers=(worker,))
    with pytest.raises(ConfigError, match="field 'decode_ms_per_token'"):
        WorkerConfig("w", "a", 0.1, -1.0, 1, 1)


# ---------------------------------------------------------------- derived latencies


def test_derive_one_way_ms_formula() -> None:
    assert derive_one_way_ms(10.0, 20.0, 10.0, 20.0) == pytest.approx(2.0)
    # A quarter of the equator: 2*pi*6371/4 km, at 200 km/ms, inflated 1.5x, plus 2 ms.
    quarter = 2 * math.pi * 6371.0 / 4
    assert derive_one_way_ms(0.0, 0.0, 0.0, 90.0) == pytest.approx(quarter / 200 * 1.5 + 2)
    assert derive_one_way_ms(0.0, 0.0, 0.0, 90.0) == pytest.approx(derive_one_way_ms(0.0, 90.0, 0.0, 0.0))


def test_missing_link_is_derived_from_coordinates_and_dumped_explicitly() -> None:
    data = minimal()
    data["links"] = []
    data["regions"] = [{"name": "a", "latitude": 0.0, "longitude": 0.0},
                       {"name": "b", "latitude": 0.0, "longitude": 90.0}]
    cfg = parse_config(data, "x")
    (link,) = cfg.links
    assert link.derived and link.between == ("a", "b")
    assert cfg.one_way_ms("b", "a") == pytest.approx(derive_one_way_ms(0, 0, 0, 90), abs=1e-3)
    text = dump_config(cfg)
    assert "derived from great-circle distance" in text
    assert parse_config(tomllib.loads(text), "dump") == cfg


# ---------------------------------------------------------------- generated configs round-trip

_names = st.text(alphabet="abcdefghijklmnopqrstuvwxyz0123456789-_", min_size=1, max_size=8).filter(
    lambda s: s[0].isalnum())


@st.composite
def configs(draw) -> dict:
    regions = draw(st.lists(_names, min_size=1, max_size=4, unique=True))
    data: dict = {"cluster": {"name": draw(_names), "model": draw(st.text(min_size=1, max_size=12)),
                              "tenant": draw(st.text(max_size=6)), "shards": draw(st.integers(1, 4))},
                  "regions": [], "links": [], "workers": []}
    positioned = draw(st.booleans())
    for name in regions:
        region = {"name": name}
        if positioned:
            region.update(latitude=draw(st.floats(-90, 90)), longitude=draw(st.floats(-180, 180)))
        data["regions"].append(region)
    for i, a in enumerate(regions):
        for b in regions[i + 1:]:
            if not positioned or draw(st.booleans()):
                data["links"].append({"between": [a, b], "one_way_ms": draw(st.floats(0, 300))})
    for i in range(draw(st.integers(1, 6))):
        data["workers"].append({
            "id": f"w{i}", "region": draw(st.sampled_from(regions)),
            "prefill_ms_per_token": draw(st.floats(0.001, 1.0)), "decode_ms_per_token": 10,
            "vram_kv_tokens": draw(st.integers(0, 10**7)), "dram_kv_tokens": 5,
            "http": draw(st.none() | st.just(f"http://127.0.0.1:{30000 + i}")),
            "agent_metrics": draw(st.none() | st.just(f"127.0.0.1:{9200 + i}")),
        })
    if draw(st.booleans()):
        data["maintenance"] = [{"id": f"m{s}", "shard": s, "quic": f"127.0.0.1:{7450 + s}",
                                "metrics": f"127.0.0.1:{9100 + s}"}
                               for s in range(data["cluster"]["shards"])]
    data["score"] = {"wan": draw(st.sampled_from(["rtt", "one_way"])), "tau_ms": draw(st.floats(1, 1000))}
    return data


@settings(max_examples=100, deadline=None)
@given(configs())
def test_generated_configs_round_trip_and_matrix_is_complete_and_symmetric(data: dict) -> None:
    cfg = parse_config(data, "gen")
    assert parse_config(tomllib.loads(dump_config(cfg)), "dump") == cfg
    names = cfg.region_names()
    assert len(cfg.links) == len(names) * (len(names) - 1) // 2
    for a in names:
        for b in names:
            assert cfg.one_way_ms(a, b) == cfg.one_way_ms(b, a) >= 0
            assert cfg.rtt_ms(a, b) == 2 * cfg.one_way_ms(a, b)


def test_dump_escapes_strings_toml_would_reject() -> None:
    data = minimal()
    data["cluster"].update(model='we"ird\\model\x7f\x01\n', tenant="tën\tant")
    cfg = parse_config(data, "x")
    assert parse_config(tomllib.loads(dump_config(cfg)), "dump") == cfg


# ---------------------------------------------------------------- socket collisions

SHIPPED = sorted((Path(__file__).resolve().parent.parent / "config").glob("*.toml"))


def test_the_repository_ships_its_configs() -> None:
    names = {p.name for p in SHIPPED}
    assert {"testbed-3continent.toml", "production-3region.toml"} <= names, names


@pytest.mark.parametrize("path", SHIPPED, ids=lambda p: p.name)
def test_every_shipped_config_loads_with_distinct_sockets(path: Path) -> None:
    cfg = load_config(path)
    sockets = config_sockets(cfg)
    keys = [(s.transport, s.host, s.port) for s in sockets]
    assert len(keys) == len(set(keys))
    if cfg.workers[0].kv_events:  # the deployable configs: every replay socket is accounted for
        publishing = sum(w.kv_events is not None for w in cfg.workers)  # decode workers publish nothing
        assert sum(s.owner.endswith("replay (port + 1)") for s in sockets) == publishing
        assert publishing == sum(w.role != "decode" for w in cfg.workers)


def addressed() -> dict:
    data = minimal()
    for i, worker in enumerate(data["workers"]):
        worker.update(http=f"http://127.0.0.1:{30000 + i}", kv_events=f"tcp://127.0.0.1:{5557 + 2 * i}",
                      agent=f"127.0.0.1:{7500 + i}")
    data["edges"] = [{"id": "edge-a", "region": "a", "http": "0.0.0.0:8080", "quic": "127.0.0.1:7400"}]
    data["maintenance"] = [{"id": f"mnt-{s}", "shard": s, "quic": f"127.0.0.1:{7450 + s}"} for s in range(2)]
    return data


def test_addressed_fixture_is_valid() -> None:
    assert len(config_sockets(parse_config(addressed()))) == 2 * 4 + 2 + 2


def test_consecutive_kv_event_ports_collide_with_the_replay_socket_naming_both() -> None:
    data = addressed()
    data["workers"][1]["kv_events"] = "tcp://127.0.0.1:5558"
    message = error_of(data)
    assert "[[workers]] #2 (b-0) kv_events binds tcp 127.0.0.1:5558" in message
    assert "[[workers]] #1 (a-0) kv_events replay (port + 1)" in message


@pytest.mark.parametrize("mutate, first, second", [
    (lambda d: d["maintenance"][1].update(quic="127.0.0.1:7400"), "(edge-a) quic", "(mnt-1) quic"),
    (lambda d: d["workers"][1].update(agent="localhost:7500"), "(a-0) agent", "(b-0) agent"),
    (lambda d: d["edges"][0].update(metrics="127.0.0.1:30001"), "(b-0) http", "(edge-a) metrics"),
    (lambda d: d["workers"][0].update(agent_metrics="127.0.0.1:8080"), "(a-0) agent_metrics", "(edge-a) http"),
    (lambda d: d["maintenance"][0].update(metrics="[::1]:9100") or d["edges"][0].update(metrics="[::1]:9100"),
     "(edge-a) metrics", "(mnt-0) metrics"),
], ids=["quic", "localhost-is-loopback", "metrics-vs-http", "agent-metrics-vs-wildcard", "ipv6"])
def test_sockets_sharing_a_port_on_one_host_are_refused(mutate, first: str, second: str) -> None:
    data = addressed()
    mutate(data)
    message = error_of(data)
    assert first in message and second in message and "cannot share a port" in message


def test_tcp_and_udp_may_share_a_port_and_distinct_hosts_may_share_everything() -> None:
    data = addressed()
    data["edges"][0]["http"] = "127.0.0.1:7400"  # TCP beside the edge's own QUIC (UDP) port
    data["workers"][1].update(http="http://10.0.0.2:30000", kv_events="tcp://10.0.0.2:5557",
                              agent="10.0.0.2:7500")
    parse_config(data)


def test_wildcard_binds_belong_to_their_entrys_host() -> None:
    data = addressed()
    data["regions"].append({"name": "c"})
    data["links"] += [{"between": ["a", "c"], "one_way_ms": 50.0}, {"between": ["b", "c"], "one_way_ms": 50.0}]
    # Two gateways on two hosts, each binding 0.0.0.0:8080, as production-3region does.
    data["edges"].append({"id": "edge-c", "region": "c", "http": "0.0.0.0:8080", "quic": "10.0.0.9:7400"})
    parse_config(data)
    # The edge's wildcard is on 127.0.0.1 (its QUIC host): a worker's HTTP port there collides.
    data["workers"][0]["http"] = "http://127.0.0.1:8080"
    assert "(edge-a) http" in error_of(data)


def test_an_explicit_replay_endpoint_replaces_the_port_plus_one_default() -> None:
    data = addressed()
    data["workers"][1]["kv_events"] = "tcp://127.0.0.1:5558"  # the replay port of a-0 by default
    data["workers"][0]["kv_events_replay"] = "tcp://127.0.0.1:5600"
    parse_config(data)
    data["workers"][1]["kv_events_replay"] = "tcp://127.0.0.1:5600"
    message = error_of(data)
    assert "(a-0) kv_events_replay" in message and "(b-0) kv_events_replay" in message


def test_replay_port_past_65535_is_refused() -> None:
    data = addressed()
    data["workers"][0]["kv_events"] = "tcp://127.0.0.1:65535"
    assert "outside 1-65535" in error_of(data)


def test_command_line_override_is_checked_against_the_config() -> None:
    cfg = parse_config(addressed())
    check_socket_collisions(cfg, {"edge-a": {"metrics": "127.0.0.1:9101"}})
    with pytest.raises(ConfigError, match=r"\(edge-a\) metrics \(command line\) binds tcp 127.0.0.1:5557"):
        check_socket_collisions(cfg, {"edge-a": {"metrics": "0.0.0.0:5557"}})


def test_ipc_kv_events_bind_no_port() -> None:
    data = addressed()
    data["workers"][0]["kv_events"] = "ipc:///run/sglang/kv"
    assert len(config_sockets(parse_config(data))) == 2 * 4 + 2 + 2 - 2


@st.composite
def one_host_ports(draw) -> dict:
    """Workers, an edge and a maintenance unit on one host, on ports from a small range so that
    collisions are common."""
    port = st.integers(7000, 7012)
    data = minimal()
    for worker in data["workers"]:
        worker.update(http=f"http://127.0.0.1:{draw(port)}", kv_events=f"tcp://127.0.0.1:{draw(port)}",
                      agent=f"127.0.0.1:{draw(port)}")
    data["edges"] = [{"id": "edge-a", "region": "a", "http": f"127.0.0.1:{draw(port)}",
                      "quic": f"127.0.0.1:{draw(port)}", "metrics": f"127.0.0.1:{draw(port)}"}]
    data["maintenance"] = [{"id": f"mnt-{s}", "shard": s, "quic": f"127.0.0.1:{draw(port)}"} for s in range(2)]
    return data


@settings(max_examples=200, deadline=None)
@given(one_host_ports())
def test_loader_refuses_exactly_the_configs_where_two_sockets_share_a_port(data: dict) -> None:
    def port(address: str) -> int:
        return int(address.rsplit(":", 1)[1])

    tcp = [port(w["http"]) for w in data["workers"]] + [port(w["kv_events"]) for w in data["workers"]]
    tcp += [port(w["kv_events"]) + 1 for w in data["workers"]]
    tcp += [port(data["edges"][0]["http"]), port(data["edges"][0]["metrics"])]
    udp = [port(w["agent"]) for w in data["workers"]] + [port(data["edges"][0]["quic"])]
    udp += [port(m["quic"]) for m in data["maintenance"]]
    clash = len(set(tcp)) < len(tcp) or len(set(udp)) < len(udp)
    if clash:
        assert "cannot share a port" in error_of(data)
    else:
        parse_config(data)
def test_worker_kv_events_topic_and_replay_endpoint() -> None:
    data = minimal()
    assert parse_config(data, "<t>").worker("a-0").kv_events_topic == ""  # the engines' default
    data["workers"][0].update(kv_events="tcp://10.0.0.5:5557", kv_events_topic="kv-events",
                              kv_events_replay="tcp://10.0.0.5:5558")
    cfg = parse_config(data, "<t>")
    worker = cfg.worker("a-0")
    assert (worker.kv_events_topic, worker.kv_events_replay) == ("kv-events", "tcp://10.0.0.5:5558")
    assert parse_config(tomllib.loads(dump_config(cfg)), "<t>") == cfg
    for field, value, fragment in (("kv_events_topic", "x" * 256, "255 bytes"), ("kv_events_topic", 5, "string"),
                                   ("kv_events_replay", "http://h:1", "kv_events_replay")):
        bad = minimal()
        bad["workers"][0][field] = value
        with pytest.raises(ConfigError, match=fragment):
            parse_config(bad, "<t>")
# ---------------------------------------------------------------- deadlines and authority


def test_deadlines_default_parse_validate_and_round_trip() -> None:
    assert parse_config(minimal()).deadlines == DeadlineParams()
    data = minimal()
    data["deadlines"] = {"first_token_floor_s": 0.5, "inter_token_s": 3, "suspect_initial_s": 2.0,
                         "first_token_max_s": 30}
    cfg = parse_config(data)
    assert cfg.deadlines.inter_token_s == 3.0 and isinstance(cfg.deadlines.inter_token_s, float)
    assert cfg.deadlines.first_token_max_s == 30.0 and isinstance(cfg.deadlines.first_token_max_s, float)
    assert parse_config(tomllib.loads(dump_config(cfg))) == cfg
    for bad, field in [({"inter_token_s": 0}, "inter_token_s"), ({"first_token_factor": -1.0}, "first_token_factor"),
                       ({"first_token_max_s": 0.0}, "first_token_max_s"),
                       ({"suspect_initial_s": 10.0, "suspect_max_s": 5.0}, "suspect_max_s"),
                       ({"frist_token_floor_s": 1.0}, "frist_token_floor_s")]:
        data["deadlines"] = bad
        assert error_of(data).startswith(f"x.toml: [deadlines] field '{field}': ")


def test_each_shard_has_the_owner_its_maintenance_unit_names() -> None:
    data = minimal()
    data["maintenance"] = [{"id": "mnt-x", "shard": 1}, {"id": "mnt-y", "shard": 0}]
    data["edges"] = [{"id": "edge-b", "region": "b"}]
    cfg = parse_config(data)
    assert [cfg.shard_owner(s) for s in (0, 1, 2)] == ["mnt-y", "mnt-x", None]
    assert cfg.edge_region("edge-b") == "b" and cfg.edge_region("mnt-x") is None
    assert parse_config(minimal()).shard_owner(0) is None  # no units configured: nobody may write
def test_frontdoor_limits_are_read_validated_and_dumped() -> None:
    data = minimal()
    data["frontdoor"] = {"max_body_bytes": 1 << 20, "header_timeout_s": 5}
    cfg = parse_config(data)
    assert cfg.frontdoor.max_body_bytes == 1 << 20 and cfg.frontdoor.header_timeout_s == 5.0
    assert parse_config(tomllib.loads(dump_config(cfg))) == cfg
    data["frontdoor"] = {"max_body_bytes": 1 << 30, "body_budget_bytes": 1 << 20}
    with pytest.raises(ConfigError, match=r"\[frontdoor\] field 'body_budget_bytes': must be >= max_body_bytes"):
        parse_config(data)
    data["frontdoor"] = {"max_body": 1}
    with pytest.raises(ConfigError, match=r"\[frontdoor\] field 'max_body': unknown field"):
        parse_config(data)


# ---------------------------------------------------------------- prefill-decode roles


def disaggregated() -> dict:
    data = minimal()
    data["workers"] = [
        {**data["workers"][0], "role": "prefill", "bootstrap_port": 8998},
        {**data["workers"][0], "id": "a-1", "role": "decode"},
        data["workers"][1],
    ]
    return data


def test_worker_roles_default_to_mixed_and_round_trip() -> None:
    cfg = parse_config(disaggregated(), "x.toml")
    assert [w.role for w in cfg.workers] == ["prefill", "decode", "mixed"]
    assert cfg.disaggregated and not parse_config(minimal(), "x.toml").disaggregated
    assert [cfg.routable(w) for w in cfg.workers] == [True, False, True]
    assert parse_config(tomllib.loads(dump_config(cfg)), "y.toml") == cfg


@pytest.mark.parametrize("mutate, expected", [
    (lambda d: d["workers"][0].update(role="leader"), "[[workers]] #1 field 'role': expected one of mixed, prefill, decode, got 'leader'"),
    (lambda d: d["workers"].pop(1), "[[workers]] field 'role': region 'a' has prefill workers but no decode worker"),
    (lambda d: d["workers"][1].update(kv_events="tcp://127.0.0.1:5557"), "a decode worker publishes nothing"),
    (lambda d: d["workers"][2].update(bootstrap_port=8998), "only a prefill worker has a bootstrap port"),
    (lambda d: d["workers"][0].update(bootstrap_port=70000), "bootstrap_port"),
])
def test_role_errors_name_the_table_and_field(mutate, expected: str) -> None:
    data = disaggregated()
    mutate(data)
    assert expected in error_of(data)


def test_a_fleet_of_decode_workers_only_is_refused() -> None:
    data = minimal()
    for w in data["workers"]:
        w["role"] = "decode"
    assert "every worker is a decode worker" in error_of(data)


@pytest.mark.parametrize("gbps", [0, -5.0, float("inf"), "fast"])
def test_kv_transfer_bandwidth_must_be_a_positive_number(gbps) -> None:
    data = disaggregated()
    data["workers"][0]["kv_transfer_gbps"] = gbps
    assert "field 'kv_transfer_gbps'" in error_of(data)


def test_kv_transfer_bandwidth_defaults_and_round_trips() -> None:
    data = disaggregated()
    data["workers"][0]["kv_transfer_gbps"] = 25
    cfg = parse_config(data, "x.toml")
    assert cfg.workers[0].kv_transfer_gbps == 25.0 and isinstance(cfg.workers[0].kv_transfer_gbps, float)
    assert cfg.workers[1].kv_transfer_gbps == 100.0
    assert parse_config(tomllib.loads(dump_config(cfg)), "y.toml") == cfg


# ---------------------------------------------------------------- [sync]


def test_sync_defaults_parse_validate_and_round_trip() -> None:
    from kvcompassd.core.config import SyncParams

    assert parse_config(minimal()).sync == SyncParams()
    data = minimal()
    data["sync"] = {"snapshot_chunk_bytes": 65536, "max_snapshot_entries": 1000}
    cfg = parse_config(data)
    assert cfg.sync.snapshot_chunk_bytes == 65536 and cfg.sync.max_snapshot_entries == 1000
    assert parse_config(tomllib.loads(dump_config(cfg))) == cfg
    for bad, field in [({"snapshot_chunk_bytes": (1 << 20) + 1}, "snapshot_chunk_bytes"),  # over the wire's bound
                       ({"snapshot_chunk_bytes": 65536, "snapshot_window_bytes": 4096}, "snapshot_window_bytes"),
                       ({"max_snapshot_bytes": 0}, "max_snapshot_bytes"),
                       ({"max_buffered_bytes": -1}, "max_buffered_bytes")]:
        data["sync"] = bad
        assert error_of(data).startswith(f"x.toml: [sync] field '{field}': ")


def test_sync_position_heartbeat_parses_validates_and_round_trips() -> None:
    assert parse_config(minimal()).sync.position_heartbeat_ms == 1000.0
    data = minimal()
    for value in (250, 0):  # 0: off (edges older than the announcement, until upgraded)
        data["sync"] = {"position_heartbeat_ms": value}
        cfg = parse_config(data)
        assert cfg.sync.position_heartbeat_ms == float(value) and isinstance(cfg.sync.position_heartbeat_ms, float)
        assert parse_config(tomllib.loads(dump_config(cfg))) == cfg
    for bad in (5, -1, 60_001, True, "1s"):
        data["sync"] = {"position_heartbeat_ms": bad}
        assert error_of(data).startswith("x.toml: [sync] field 'position_heartbeat_ms': ")


def test_sync_coalescing_windows_parse_validate_and_round_trip() -> None:
    """[sync] report_delay_ms (agents) and batch_delay_ms (maintenance units): 20 and 10 ms by
    default, 0 (the next loop turn) up to 100 ms, floats."""
    sync = parse_config(minimal()).sync
    assert (sync.report_delay_ms, sync.batch_delay_ms) == (20.0, 10.0)
    data = minimal()
    for value in (0, 2.5, 100):
        data["sync"] = {"report_delay_ms": value, "batch_delay_ms": value}
        cfg = parse_config(data)
        assert cfg.sync.report_delay_ms == cfg.sync.batch_delay_ms == float(value)
        assert isinstance(cfg.sync.report_delay_ms, float) and isinstance(cfg.sync.batch_delay_ms, float)
        assert parse_config(tomllib.loads(dump_config(cfg))) == cfg
    for field in ("report_delay_ms", "batch_delay_ms"):
        for bad in (-0.5, 100.5, True, "5ms", float("nan")):
            data["sync"] = {field: bad}
            assert error_of(data).startswith(f"x.toml: [sync] field '{field}': ")


def test_disaggregation_table_is_validated_and_round_trips() -> None:
    data = disaggregated()
    data["disaggregation"] = {"decode_policy": "random", "kv_bytes_per_token": 65536, "transfer_timeout_s": 5}
    cfg = parse_config(data, "x.toml")
    assert (cfg.disaggregation.decode_policy, cfg.disaggregation.kv_bytes_per_token) == ("random", 65536)
    assert parse_config(tomllib.loads(dump_config(cfg)), "y.toml") == cfg
    assert cfg.decode_workers_in("a") == (cfg.workers[1],) and cfg.decode_workers_in("b") == ()
    for bad, expected in [({"decode_policy": "round_robin"}, "field 'decode_policy': expected one of least_loaded, random"),
                          ({"kv_transfer_gb_per_s": 12.5}, "[disaggregation] field 'kv_transfer_gb_per_s': unknown field"),
                          ({"kv_bytes_per_token": 0}, "kv_bytes_per_token"),
                          ({"transfer_timeout_s": -1}, "transfer_timeout_s"),
                          ({"bandwidth": 1}, "[disaggregation] field 'bandwidth': unknown field")]:
        data["disaggregation"] = bad
        assert expected in error_of(data)


def test_a_prefill_workers_bootstrap_port_is_one_of_its_hosts_sockets() -> None:
    data = disaggregated()
    data["workers"][0].update(http="http://10.0.0.1:30000", bootstrap_port=30000)
    assert "bootstrap_port binds tcp 10.0.0.1:30000" in error_of(data)
    del data["workers"][0]["bootstrap_port"]
    cfg = parse_config(data, "x.toml")  # SGLang's default port, 8998, is free on that host
    assert bootstrap_port_of(cfg.workers[0]) == SGLANG_BOOTSTRAP_PORT == 8998


def test_idle_heartbeat_defaults_parses_validates_and_round_trips() -> None:
    from kvcompassd.core.config import IdleParams

    assert parse_config(minimal()).idle == IdleParams() and IdleParams().heartbeat_ms == 1000.0
    data = minimal()
    data["idle"] = {"heartbeat_ms": 2500, "engine_probe_max_ms": 4000, "load_tolerance_ms": 0, "load_tolerance_share": 0.1,
                    "sole_edge_poll_ms": 50}
    cfg = parse_config(data)
    assert cfg.idle.heartbeat_ms == 2500.0 and isinstance(cfg.idle.heartbeat_ms, float)
    assert cfg.idle.engine_probe_max_ms == 4000.0
    assert cfg.idle.load_tolerance_ms == 0.0 and isinstance(cfg.idle.load_tolerance_ms, float)
    assert cfg.idle.load_tolerance_share == 0.1
    assert cfg.idle.sole_edge_poll_ms == 50.0 and isinstance(cfg.idle.sole_edge_poll_ms, float)
    assert IdleParams().sole_edge_poll_ms == 100.0
    assert parse_config(tomllib.loads(dump_config(cfg))) == cfg
    for bad, expected in [({"heartbeat_ms": 0}, "[idle] field 'heartbeat_ms': must be > 0"),
                          ({"heartbeat_ms": 20_000}, "[idle] field 'heartbeat_ms': must be <= 10000"),
                          ({"heartbeat_ms": "1s"}, "[idle] field 'heartbeat_ms': expected a number"),
                          ({"period_ms": 1}, "[idle] field 'period_ms': unknown field"),
                          ({"engine_probe_max_ms": 500}, "[idle] field 'engine_probe_max_ms': must be >= 1000"),
                          ({"engine_probe_max_ms": 120_000}, "[idle] field 'engine_probe_max_ms': must be <= 60000"),
                          ({"load_tolerance_ms": -1}, "[idle] field 'load_tolerance_ms': must be >= 0"),
                          ({"load_tolerance_ms": 500}, "[idle] field 'load_tolerance_ms': must be <= 100"),
                          ({"load_tolerance_share": 0.9}, "[idle] field 'load_tolerance_share': must be <= 0.5"),
                          ({"sole_edge_poll_ms": -5}, "[idle] field 'sole_edge_poll_ms': must be >= 0"),
                          ({"sole_edge_poll_ms": 5000}, "[idle] field 'sole_edge_poll_ms': must be <= 1000"),
                          ({"sole_edge_poll_ms": True}, "[idle] field 'sole_edge_poll_ms': expected a number")]:
        data["idle"] = bad
        assert expected in error_of(data)
    # Slower than the broadcast period would make a changing value wait for a heartbeat.
    data["idle"] = {"heartbeat_ms": 50}
    assert "[idle] field 'heartbeat_ms': must be >= [score] broadcast_period_ms (100.0)" in error_of(data)
