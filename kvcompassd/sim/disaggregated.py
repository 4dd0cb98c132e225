"""Prefill-decode disaggregation in the simulator (paper App. C, Fig. 18).

A deployment whose workers carry ``role = "prefill"`` or ``"decode"`` runs as two pools. Per
request: arrival at its edge -> ``policy.route`` picks a *prefill* worker (decode workers are
never routed to: ``Topology.routable``) -> WAN to it -> its prefix cache and FIFO prefill queue
(``WorkerQueueModel``, the prompt only: one output token) -> at the prefill's end the prompt's KV
enters that worker's cache (so only prefill workers' caches reach the index; an answer enters
when the next turn's prompt, which contains it, is prefilled) and the prefill response (reused
tokens, queue vector) returns to the edge -> the **KV transfer**: the whole prompt's KV
(``prompt_tokens x KV_BYTES_PER_TOKEN``) over the prefill worker's link at its
``kv_transfer_gbps``, transfers from one worker one after another (``_TRANSFER_DONE`` event) ->
the decode worker (``DecodeQueueModel``) streams the first token after its first decode step
and the rest after the remaining steps -> back over the WAN from the decode worker's region.

So a lone request's TTFT is exactly
``one_way(edge, r) + lookup + prefill + transfer + decode_step(1) + one_way(r, edge)``.

The decode worker is drawn uniformly at random among the decode workers of the prefill's region
(the paper's control: "drawn at random within the prefill's region identically for all
schemes"): the k-th arriving request takes the k-th number of one random stream seeded by
``SimSettings.seed`` alone, so two schemes replaying the same requests give every request the
same draw, and differ only in which region (and so which decode pool) it lands in.
Decode workers publish nothing: they have no prefix cache in the index, and the policy gets no
load report from them.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvcompassd.worker.decodemodel import KV_BYTES_PER_TOKEN, DecodeQueueModel, kv_transfer_ms
from kvcompassd.worker.workermodel import FirstTokenProduced, RequestFinished

from .engine import (FIRST_SUBCLASS_EVENT, Simulation, SimSettings, SimulationError, _InFlight, decode_share_ms)
from .policy import PolicyError, RoutingPolicy, Topology
from .workloads import Request

_TRANSFER_DONE = FIRST_SUBCLASS_EVENT
# The decode draws' stream: the run's seed and this tag, so it is independent of every other
# random stream of a run (WAN jitter, update loss) and identical across schemes.
DECODE_DRAW_STREAM = 0xD1CE


class DisaggregatedSimulation(Simulation):
    """``Simulation`` with prefill and decode pools; records add ``decode_worker`` and
    ``transfer_ms`` (the KV hand-over, waiting for the link included)."""

    def __init__(self, topo: Topology, policy: RoutingPolicy, settings: SimSettings = SimSettings()) -> None:
        super().__init__(topo, policy, settings)
        cfg = topo.config
        workers = [cfg.worker(w) for w in topo.worker_ids]
        self.role = [w.role for w in workers]
        if "mixed" in self.role:
            raise SimulationError("a disaggregated simulation needs every worker to be a prefill or decode "
                                  "worker (mixed workers would need both paths)")
        self._decoders_in = [np.flatnonzero((topo.worker_region == r) & ~topo.routable)
                             for r in range(len(topo.regions))]
        self._is_decode = ~topo.routable
        self._gbps = [w.kv_transfer_gbps for w in workers]
        for w in np.flatnonzero(self._is_decode):
            self.models[w] = DecodeQueueModel(self.timings[w])  # same wake/advance interface as the prefill model
        self._link_free_at = np.zeros(topo.n_workers)  # when each prefill worker's link is next free
        self._decode_rng = np.random.default_rng([settings.seed, DECODE_DRAW_STREAM])
        self._decode_of: dict[str, int] = {}
        self._transfer_ms: dict[str, float] = {}
        self._rows["decode_worker"] = []
        self._rows["transfer_ms"] = []

    # ------------------------------------------------------------------------------ prefill side

    def _arrive(self, req: Request, now: float) -> None:
        draw = self._decode_rng.random()  # drawn whatever the scheme decides: one number per request
        super()._arrive(req, now)
        rid = str(req.id)
        w = self._inflight[rid].worker
        if self._is_decode[w]:
            raise PolicyError(f"{getattr(self.policy, 'name', self.policy)} routed request {req.id} to decode "
                              f"worker {self.topo.worker_ids[w]}")
        pool = self._decoders_in[int(self.topo.worker_region[w])]
        self._decode_of[rid] = int(pool[int(draw * len(pool))])

    # A prefill worker's KV stays pinned through its transfer, which its queue model does not
    # see (no finish would wake a request waiting for room): its prefills start as they come.
    _admit_only_if_room = False

    def _output_tokens_here(self, st: _InFlight) -> int:
        # The prefill worker computes the prompt and samples one token; decoding is elsewhere.
        return 1 if not st.migration else super()._output_tokens_here(st)

    def _finished(self, w: int, rid: str, now: float) -> None:
        """A prefill-only request's KV stays pinned until its transfer ends (``_TRANSFER_DONE``)."""
        if self._inflight[rid].migration:
            super()._finished(w, rid, now)

    def _account_load(self, w: int, now: float, st: _InFlight) -> None:
        """A prefill worker's load is the prefill alone (its decode share is the decode worker's)."""
        self._add_load(w, now, self.timings[w].prefill_ms(st.req.prompt_tokens - st.cached_vram - st.cached_dram,
                                                          st.cached_dram))

    def _served(self, w: int, rid: str, st: _InFlight, at: float) -> None:
        """The prefill is done (its one token sampled): hand the prompt's KV over. The KV stays
        pinned on the prefill worker until the transfer ends."""
        start = max(at, self._link_free_at[w])
        done = start + kv_transfer_ms(st.req.prompt_tokens, self._gbps[w], bytes_per_token=KV_BYTES_PER_TOKEN) / 1000
        self._link_free_at[w] = done
        self._transfer_ms[rid] = (done - at) * 1000.0
        self._push(done, _TRANSFER_DONE, rid)

    def _other_event(self, kind: int, payload: Any, now: float) -> None:
        if kind != _TRANSFER_DONE:
            super()._other_event(kind, payload, now)
            return
        rid = payload
        st = self._inflight[rid]
        self.caches[st.worker].unlock(st.lease)
        d = self._decode_of[rid]
        self.models[d].admit(rid, st.req.output_tokens, now=now)
        self._add_load(d, now, decode_share_ms(self.timings[d], st.req.output_tokens))
        self._process_worker(d, now)

    def _add_load(self, w: int, now: float, work_ms: float) -> None:
        key = (w, int(now // self.s.load_bin_s))
        self._load[key] = self._load.get(key, 0.0) + work_ms

    # ------------------------------------------------------------------------------ decode side

    def _process_worker(self, w: int, now: float, *, admitted: float | None = None) -> None:
        if not self._is_decode[w]:
            super()._process_worker(w, now, admitted=admitted)
            return
        back_from = int(self.topo.worker_region[w])
        for ev in self.models[w].advance(now=now):
            rid = ev.request_id
            st = self._inflight[rid]
            if isinstance(ev, FirstTokenProduced):
                st.ttft_s = ev.at + self._one_way_s(back_from, st.edge_region) - st.req.arrival_s
            elif isinstance(ev, RequestFinished):
                self._record(st, ev.at + self._one_way_s(back_from, st.edge_region))
                self._rows["decode_worker"].append(self._decode_of.pop(rid))
                self._rows["transfer_ms"].append(self._transfer_ms.pop(rid))
                del self._inflight[rid]
        self._schedule_wake(w)  # decode workers report no load: nothing routes to them


__all__ = ["DECODE_DRAW_STREAM", "DisaggregatedSimulation"]
