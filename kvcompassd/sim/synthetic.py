"""Synthetic workload generators: Mixed (§5.1), WildChat-like and LMSYS-like chat, Azure-shaped,
and long-context sessions (documents and agents of 32 K-128 K tokens; ``LongContextWorkload``).

Every generator is a lazy, seeded iterator of ``Request`` in arrival order. A *session* is a
conversation or an agent trajectory; its turns arrive after think times, and every turn's
prompt extends the previous one (history + the model's previous answer + the new user text),
so follow-up turns can reuse the KV cache of the earlier turn. 50 tenants each replay the
workload behind a private system prompt (§5.3, appendix A), so nothing is shared across tenants.

Parameter sources (means of the public datasets the paper uses):
- ToolBench / StableToolBench (Guo et al. 2024): tool-use trajectories average ~4 API calls, tool
  documentation of 1-3K tokens per tool set at the head of the prompt; observations ~200 tokens.
- LooGLE (Li et al. 2024): 776 long documents, ~20K words on average; several questions per
  document. We cap documents at 32K tokens (Llama-3.1-8B serves 128K, but the heavy tail would
  dominate the work of a 5 % share) and use a 10K-token median.
- APPS (Hendrycks et al. 2021): 10,000 problems, median statement ~450 tokens, solutions ~250.
- WildChat (Zhao et al. 2024, Table 1): 2.52 turns per conversation, user turns 295 tokens mean
  (heavy-tailed), assistant turns 441 tokens mean; many first turns repeat popular templates
  (the source of the paper's cross-region reuse, §2.1).
- LMSYS-Chat-1M (Zheng et al. 2024, Table 1): 2.0 turns, 69.5 tokens per prompt, 214.5 per response.
Calibration of Mixed to the paper's simulator: the paper publishes two statistics of its
simulated Mixed service times (§3.5, Fig. 9): the no-reuse capacity of the 64-worker census,
lambda0 ~ 667 req/s (Fig. 9's two x-axes: 1000 req/s is 1.5 lambda0), and a service-time
squared coefficient of variation of 5.4. At beta = 0.085 ms/token that is a mean prompt of
~1.1K tokens with a heavy tail. The datasets' full lengths (~2.7K tokens per request) would put
lambda0 near 280 req/s, and scaling every segment down alike (a first version: ~4x, mean ~1.0K)
gave the right mean but CV^2 = 0.63. The tail comes from LooGLE: its documents keep a 9K-token
median (sigma 0.6, capped at 32K; the dataset's ~20K-word documents, truncated), while the
ToolBench and APPS segments are scaled down ~8x from the dataset means, keeping proportions,
sharing structure and popularity skew. The result (tests/test_sim_workloads.py pins it): prefill
service mean 96.7 ms, lambda0 = 662 req/s on 64 workers, CV^2 = 5.5; ~1.14K prompt tokens
per Mixed request. WildChat-like averages ~830 and LMSYS-like ~630 (with history); the paper
gives no service statistics for them. Every length is a parameter.
Think time between turns is compressed to a few seconds, as in the Mooncake synthetic trace
(Poisson replay that keeps turn order), so follow-ups fall inside simulation windows.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import numpy as np

from .workloads import ArrivalProcess, AzureTrace, Request, SegmentTokens, WorkloadError, segment_key, weighted_choice

Segment = tuple[int, int, bool]  # (segment key, length, shared?)


class ZipfSampler:
    """Ranks 0..n-1 with P(rank k) ∝ 1 / (k+1)^s."""

    def __init__(self, n: int, s: float) -> None:
        if n < 1 or s < 0:
            raise WorkloadError(f"Zipf needs n >= 1 and s >= 0, got n={n}, s={s}")
        w = 1.0 / np.arange(1, n + 1, dtype=float) ** s
        self._cdf = np.cumsum(w / w.sum())

    def sample(self, rng: np.random.Generator) -> int:
        return int(min(np.searchsorted(self._cdf, rng.random(), side="right"), len(self._cdf) - 1))


def lognormal_int(rng: np.random.Generator, median: float, sigma: float, lo: int, hi: int) -> int:
    value = round(median * math.exp(sigma * rng.standard_normal()))
    return min(hi, max(lo, value))


@dataclass(frozen=True, slots=True)
class Turn:
    segments: tuple[Segment, ...]
    output_tokens: int


@dataclass(slots=True)
class _Session:
    sid: int
    region: str
    tenant: str
    turns: list[Turn]
    next_turn: int = 0


@dataclass(frozen=True, slots=True)
class CommonParams:
    tenants: int = 50
    system_prompt_tokens: tuple[int, int] = (100, 300)  # uniform range per tenant
    think_time_mean_s: float = 3.0
    prewarm_think_times: float = 6.0  # sessions start this many mean think times before t=0


class SessionWorkload:
    """Base: Poisson (or Azure-shaped) session starts, follow-up turns after think times."""

    name = "base"
    shared_segments_cached = 50_000  # shared segments' tokens kept for reuse (SegmentTokens)

    def __init__(self, rate: float, region_weights: Mapping[str, float], *, seed: int = 0,
                 common: CommonParams = CommonParams(), azure: AzureTrace | None = None) -> None:
        if common.tenants < 1:
            raise WorkloadError("tenants must be >= 1")
        self.rate = rate
        self.region_weights = dict(region_weights)
        self.seed = seed
        self.common = common
        self._azure = azure
        weighted_choice(np.random.default_rng(0), self.region_weights)  # validates the weights

    # Subclasses: expected turns per session, and a session plan.
    def mean_turns(self) -> float:
        raise NotImplementedError

    def plan(self, rng: np.random.Generator, tenant: int, sid: int) -> list[Turn]:
        raise NotImplementedError

    def mean_prompt_tokens(self, sessions: int = 2000, seed: int = 0) -> float:
        """Mean prompt tokens per request over ``sessions`` planned sessions (no tokens made):
        the mean a long run's requests have, for capacity estimates."""
        rng = np.random.default_rng(seed)
        tokens = turns = 0
        for sid in range(sessions):
            for turn in self.plan(rng, int(rng.integers(self.common.tenants)), sid):
                tokens += sum(seg[1] for seg in turn.segments)
                turns += 1
        return tokens / turns

    def system_prompt(self, tenant: int) -> Segment:
        lo, hi = self.common.system_prompt_tokens
        length = lo + segment_key(self.name, "sys-len", tenant) % (hi - lo + 1)
        return (segment_key(self.name, "system", tenant), int(length), True)

    def __iter__(self) -> Iterator[Request]:
        segs = SegmentTokens(self.shared_segments_cached)
        for rid, (t, session, turn) in enumerate(self._emitted_turns()):
            tokens = np.concatenate([segs.get(k, n, shared=shared) for k, n, shared in turn.segments])
            yield Request(rid, t, session.region, session.sid, tokens, turn.output_tokens, session.tenant)

    def prompt_lengths(self) -> Iterator[int]:
        """The prompt length of each request ``iter`` yields, in order, without making tokens
        (what a fleet's no-reuse capacity needs: making 20,000 prompts' tokens took ~14 s)."""
        for _, _, turn in self._emitted_turns():
            yield sum(n for _, n, _ in turn.segments)

    def _emitted_turns(self) -> Iterator[tuple[float, _Session, Turn]]:
        """Each emitted turn with its arrival time and session, in arrival order."""
        rng = np.random.default_rng(self.seed)
        starts = ArrivalProcess(self.rate / self.mean_turns(), seed=self.seed + 1, azure=self._azure).times()
        heap: list[tuple[float, int, _Session]] = []
        # Sessions start ``prewarm`` seconds before time 0 and only turns from time 0 on are
        # emitted, so the request rate is stationary from the first request (follow-up turns
        # of earlier sessions are already under way, as in a running service).
        prewarm = self.common.prewarm_think_times * self.common.think_time_mean_s
        offset = -prewarm
        next_start = next(starts) + offset
        sid = 0
        while True:
            if not heap or next_start < heap[0][0]:
                tenant = int(rng.integers(self.common.tenants))
                session = _Session(sid, weighted_choice(rng, self.region_weights), f"t{tenant}",
                                   self.plan(rng, tenant, sid))
                heapq.heappush(heap, (next_start, sid, session))
                sid += 1
                next_start = next(starts) + offset
                continue
            t, _, session = heapq.heappop(heap)
            turn = session.turns[session.next_turn]
            if t >= 0.0:
                yield t, session, turn
            session.next_turn += 1
            if session.next_turn < len(session.turns):
                gap = float(rng.exponential(self.common.think_time_mean_s))
                heapq.heappush(heap, (t + gap, session.sid, session))


def _chat_turns(prefix: list[Segment], user_lengths: list[int], answer_lengths: list[int],
                 name: str, sid: int, first_user: list[Segment] | None = None) -> list[Turn]:
    """History-accumulating turns: turn k = prefix + u1 + a1 + ... + uk."""
    turns: list[Turn] = []
    history = list(prefix)
    for k, (u, a) in enumerate(zip(user_lengths, answer_lengths)):
        if k == 0 and first_user is not None:
            history.extend(first_user)
        else:
            history.append((segment_key(name, "user", sid, k), u, False))
        turns.append(Turn(tuple(history), a))
        history.append((segment_key(name, "answer", sid, k), a, True))
    return turns


@dataclass(frozen=True, slots=True)
class MixedParams:
    tool_share: float = 0.50        # ToolBench agents
    qa_share: float = 0.05          # LooGLE long-document QA
    # APPS programming problems take the rest (0.45)
    toolsets_per_tenant: int = 2000
    toolset_zipf: float = 1.0
    toolset_tokens_median: float = 200.0
    agent_steps_mean: float = 3.0
    observation_tokens_median: float = 40.0
    agent_output_median: float = 60.0
    documents_per_tenant: int = 400
    document_zipf: float = 1.0
    document_tokens_median: float = 9000.0
    document_tokens_max: int = 32_768
    questions_mean: float = 2.0
    problems_per_tenant: int = 5000
    problem_zipf: float = 0.8
    problem_tokens_median: float = 150.0
    solution_tokens_median: float = 150.0


# Hot-skew Mixed (paper App. C, Fig. 18: "the hot-skew Mixed workload" on the RTX 5090 testbed).
# The paper names it without parameters; ours, stated here so a reader can judge them:
# - full-size segments, as the testbeds replay the datasets' prompts (module docstring: ~2.7K
#   tokens per request at the datasets' means, against ~1.1K for the simulator-calibrated Mixed):
#   ToolBench tool documentation 1.6K tokens median and ~200-token observations, APPS statements
#   ~450 tokens with ~250-token solutions; LooGLE documents as in Mixed;
# - a hot head: 4 tenants instead of 50 and steeper popularity (Zipf 1.3 over each tenant's tool
#   sets, documents and problems), so a tenant's top tool set alone draws ~3 % of all requests and
#   the top few prefixes of the fleet a sizeable share of its prefill work.
MIXED_HOT_SKEW = MixedParams(toolset_zipf=1.3, toolset_tokens_median=1600.0, observation_tokens_median=200.0,
                             document_zipf=1.3, problem_zipf=1.3, problem_tokens_median=450.0,
                             solution_tokens_median=250.0)
MIXED_HOT_SKEW_COMMON = CommonParams(tenants=4)


class MixedWorkload(SessionWorkload):
    """Mixed (§5.1): tool-calling agents 50 %, long-document QA 5 %, programming problems 45 %."""

    name = "mixed"

    def __init__(self, rate: float, region_weights: Mapping[str, float], *, seed: int = 0,
                 params: MixedParams = MixedParams(), common: CommonParams = CommonParams(),
                 azure: AzureTrace | None = None) -> None:
        super().__init__(rate, region_weights, seed=seed, common=common, azure=azure)
        if not (0 <= params.tool_share and 0 <= params.qa_share and params.tool_share + params.qa_share <= 1):
            raise WorkloadError("Mixed shares must be non-negative and sum to at most 1")
        self.params = params
        self._toolsets = ZipfSampler(params.toolsets_per_tenant, params.toolset_zipf)
        self._documents = ZipfSampler(params.documents_per_tenant, params.document_zipf)
        self._problems = ZipfSampler(params.problems_per_tenant, params.problem_zipf)

    def mean_turns(self) -> float:
        p = self.params
        return p.tool_share * p.agent_steps_mean + p.qa_share * p.questions_mean + (1 - p.tool_share - p.qa_share)

    def _item(self, kind: str, tenant: int, rank: int, median: float, sigma: float, lo: int, hi: int) -> Segment:
        # An item's length is a property of the item, so every request for it has the same prefix.
        item_rng = np.random.default_rng(segment_key(self.name, kind, "len", tenant, rank))
        return (segment_key(self.name, kind, tenant, rank), lognormal_int(item_rng, median, sigma, lo, hi), True)

    def plan(self, rng: np.random.Generator, tenant: int, sid: int) -> list[Turn]:
        p = self.params
        system = self.system_prompt(tenant)
        u = rng.random()
        if u < p.tool_share:
            toolset = self._item("toolset", tenant, self._toolsets.sample(rng), p.toolset_tokens_median, 0.5, 64, 4000)
            query = (segment_key(self.name, "query", sid), lognormal_int(rng, 60, 0.6, 10, 800), False)
            steps = int(rng.geometric(1.0 / p.agent_steps_mean))
            observations = [lognormal_int(rng, p.observation_tokens_median, 0.8, 10, 4000) for _ in range(steps)]
            outputs = [lognormal_int(rng, p.agent_output_median, 0.6, 8, 1024) for _ in range(steps)]
            first = [query]
            return _chat_turns([system, toolset], [first[0][1]] + observations[1:], outputs, self.name, sid, first)
        if u < p.tool_share + p.qa_share:
            doc = self._item("document", tenant, self._documents.sample(rng), p.document_tokens_median, 0.6, 800,
                             p.document_tokens_max)
            questions = int(rng.geometric(1.0 / p.questions_mean))
            qs = [lognormal_int(rng, 40, 0.5, 5, 300) for _ in range(questions)]
            outs = [lognormal_int(rng, 60, 0.6, 4, 512) for _ in range(questions)]
            return _chat_turns([system, doc], qs, outs, self.name, sid)
        problem = self._item("problem", tenant, self._problems.sample(rng), p.problem_tokens_median, 0.6, 64, 2500)
        return [Turn((system, problem), lognormal_int(rng, p.solution_tokens_median, 0.6, 16, 2048))]


@dataclass(frozen=True, slots=True)
class ChatParams:
    turns_mean: float
    template_share: float           # first turns that repeat a popular template
    templates_per_tenant: int
    template_zipf: float
    template_tokens_median: float
    first_user_median: float
    first_user_sigma: float
    later_user_median: float
    answer_median: float
    answer_sigma: float
    system_prompt_tokens: tuple[int, int] = field(default=(100, 400))


WILDCHAT = ChatParams(turns_mean=2.52, template_share=0.25, templates_per_tenant=3000, template_zipf=1.1,
                      template_tokens_median=300, first_user_median=60, first_user_sigma=1.2,
                      later_user_median=40, answer_median=150, answer_sigma=0.7)
LMSYS = ChatParams(turns_mean=2.0, template_share=0.15, templates_per_tenant=2000, template_zipf=1.1,
                   template_tokens_median=40, first_user_median=35, first_user_sigma=1.2,
                   later_user_median=35, answer_median=150, answer_sigma=0.9)


class ChatWorkload(SessionWorkload):
    """Multi-turn chat shaped like WildChat or LMSYS-Chat-1M (see module docstring)."""

    def __init__(self, rate: float, region_weights: Mapping[str, float], *, flavour: str = "wildchat",
                 seed: int = 0, common: CommonParams | None = None, azure: AzureTrace | None = None) -> None:
        presets = {"wildchat": WILDCHAT, "lmsys": LMSYS}
        if flavour not in presets:
            raise WorkloadError(f"chat flavour must be one of {sorted(presets)}, got {flavour!r}")
        self.params = presets[flavour]
        self.name = flavour
        common = common or CommonParams(system_prompt_tokens=self.params.system_prompt_tokens)
        super().__init__(rate, region_weights, seed=seed, common=common, azure=azure)
        self._templates = ZipfSampler(self.params.templates_per_tenant, self.params.template_zipf)

    def mean_turns(self) -> float:
        return self.params.turns_mean

    def plan(self, rng: np.random.Generator, tenant: int, sid: int) -> list[Turn]:
        p = self.params
        turns = int(rng.geometric(1.0 / p.turns_mean))
        first: list[Segment]
        if rng.random() < p.template_share:
            rank = self._templates.sample(rng)
            t_rng = np.random.default_rng(segment_key(self.name, "template-len", tenant, rank))
            template = (segment_key(self.name, "template", tenant, rank),
                        lognormal_int(t_rng, p.template_tokens_median, 0.8, 8, 4000), True)
            tail = (segment_key(self.name, "tail", sid), lognormal_int(rng, 30, 1.0, 1, 2000), False)
            first = [template, tail]
        else:
            first = [(segment_key(self.name, "user", sid, 0),
                      lognormal_int(rng, p.first_user_median, p.first_user_sigma, 2, 8000), False)]
        users = [sum(s[1] for s in first)] + [lognormal_int(rng, p.later_user_median, 1.0, 2, 4000) for _ in range(turns - 1)]
        answers = [lognormal_int(rng, p.answer_median, p.answer_sigma, 1, 2048) for _ in range(turns)]
        return _chat_turns([self.system_prompt(tenant)], users, answers, self.name, sid, first)


class AzureWorkload(SessionWorkload):
    """Single-turn requests with context/output lengths and arrival burstiness of an Azure 2023
    trace; the prompt is the tenant's system prompt followed by unique text."""

    name = "azure"

    def __init__(self, rate: float, region_weights: Mapping[str, float], trace: AzureTrace, *, seed: int = 0,
                 common: CommonParams = CommonParams()) -> None:
        super().__init__(rate, region_weights, seed=seed, common=common, azure=trace)
        self.trace = trace

    def mean_turns(self) -> float:
        return 1.0

    def plan(self, rng: np.random.Generator, tenant: int, sid: int) -> list[Turn]:
        i = int(rng.integers(len(self.trace.context_tokens)))
        system = self.system_prompt(tenant)
        body = max(1, int(self.trace.context_tokens[i]) - system[1])
        return [Turn((system, (segment_key(self.name, "body", sid), body, False)),
                     max(1, int(self.trace.generated_tokens[i])))]


@dataclass(frozen=True, slots=True)
class LongContextParams:
    """Long-context sessions (``LongContextWorkload``); lengths in tokens."""

    max_prompt_tokens: int = 131_072 - 2048  # the model's context less the longest answer
    document_share: float = 0.5     # document sessions; coding-agent sessions take the rest
    documents_per_tenant: int = 48
    document_zipf: float = 1.0
    document_tokens_median: float = 56_000.0
    document_tokens_sigma: float = 0.45
    questions_mean: float = 3.0
    question_tokens_median: float = 80.0
    answer_tokens_median: float = 250.0
    repos_per_tenant: int = 24
    repo_zipf: float = 1.0
    repo_tokens_median: float = 40_000.0
    repo_tokens_sigma: float = 0.3
    task_tokens_median: float = 600.0
    agent_steps_mean: float = 6.0
    observation_tokens_median: float = 2_500.0
    action_tokens_median: float = 150.0


LONG_COMMON = CommonParams(tenants=8, system_prompt_tokens=(300, 1200), think_time_mean_s=20.0,
                           prewarm_think_times=6.0)


class LongContextWorkload(SessionWorkload):
    """Long-context serving: documents and coding-agent sessions of 32 K-128 K tokens, multi-turn,
    their documents and repositories shared by sessions from every region.

    Calibration. No public trace gives the joint shape of long-context sessions (the Mooncake
    production trace of issue 28 has prompts up to ~126 K tokens but no session ids), so the
    parameters are chosen, not fitted, in the way Mixed's are: the public datasets' shapes,
    scaled to the model's context, and the statistics they give pinned by a test
    (tests/test_sim_workloads.py) rather than asserted here:
    - Documents (LooGLE, LongBench v2: long documents, several questions each): half the
      sessions. A document is 56 K tokens at the median (lognormal, sigma 0.45), clipped to
      32 K-``max_prompt_tokens`` less room for its questions, chosen Zipf(1.0) among its tenant's
      48; a session asks a geometric number of questions (mean 3; ~80 tokens each, answers
      ~250) about it, each turn extending the last (history + answer + question).
    - Coding agents (SWE-bench-style trajectories over a repository): the other half. The
      repository context is 40 K tokens at the median (sigma 0.3, at least 32 K), Zipf(1.0) among
      its tenant's 24, then a task statement (~600 tokens, the session's own) and a geometric
      number of steps (mean 6), each adding the previous action (~150 tokens, the output) and a
      tool observation (~2.5 K tokens, heavy-tailed); the session ends before its prompt would
      pass ``max_prompt_tokens``.
    - 8 tenants (long-context deployments serve fewer, larger customers), system prompts of
      300-1,200 tokens; sessions start in regions by the usual weights, so one tenant's
      popular documents and repositories are asked for from every region.
    - Think times of 20 s on average (tool runs and test suites; reading a long answer): a
      turn's prefill alone takes ~5 s at beta = 0.085 ms/token, so the Mixed workload's 3 s
      would send most follow-ups before their previous turn's prefix exists anywhere.
    What it gives (pinned by the test): a mean prompt of ~64 K tokens over 2,000 planned
    sessions (``mean_prompt_tokens``; 4.4 turns each, 4.2 under the testbed's cap: the request
    rate asked for is kept by starting sessions at rate / that), every prompt >= 32 K, ~30 % of the first
    3,000 requests (seed 0) >= 64 K; a mean no-reuse prefill of ~5.4 s at beta = 0.085, i.e.
    lambda0 = workers / (mean prompt x beta) ~ 11.8 req/s on census-64x8. The testbed's RTX
    5090s hold 96 K tokens of KV in VRAM, so prompts there are capped at what every worker can
    serve (``servable_prompt_tokens``: 96,256), a mean of ~60 K and lambda0 ~ 2.8 req/s.
    """

    name = "long"
    shared_segments_cached = 512  # documents and repositories are ~200 KiB of tokens each

    def __init__(self, rate: float, region_weights: Mapping[str, float], *, seed: int = 0,
                 params: LongContextParams = LongContextParams(), common: CommonParams = LONG_COMMON,
                 azure: AzureTrace | None = None) -> None:
        super().__init__(rate, region_weights, seed=seed, common=common, azure=azure)
        if not 0 <= params.document_share <= 1:
            raise WorkloadError(f"document_share must be in [0, 1], got {params.document_share!r}")
        if params.max_prompt_tokens < LONG_MIN_TOKENS + 4096:
            raise WorkloadError(f"max_prompt_tokens must be >= {LONG_MIN_TOKENS + 4096} (long prompts start at "
                                f"{LONG_MIN_TOKENS}), got {params.max_prompt_tokens!r}")
        self.params = params
        self._documents = ZipfSampler(params.documents_per_tenant, params.document_zipf)
        self._repos = ZipfSampler(params.repos_per_tenant, params.repo_zipf)
        # Sessions that would outgrow max_prompt_tokens end early, so the turns per session (and
        # with them the request rate of a given session rate) are measured on planned sessions,
        # not taken from the parameters' means (4.5; 4.2 under the testbed's 96 K cap).
        rng = np.random.default_rng(0)
        self._mean_turns = float(np.mean([len(self.plan(rng, int(rng.integers(self.common.tenants)), sid))
                                          for sid in range(2000)]))

    def mean_turns(self) -> float:
        return self._mean_turns

    def _item(self, kind: str, tenant: int, rank: int, median: float, sigma: float, hi: int) -> Segment:
        item_rng = np.random.default_rng(segment_key(self.name, kind, "len", tenant, rank))
        return (segment_key(self.name, kind, tenant, rank),
                lognormal_int(item_rng, median, sigma, LONG_MIN_TOKENS, hi), True)

    def plan(self, rng: np.random.Generator, tenant: int, sid: int) -> list[Turn]:
        p = self.params
        system = self.system_prompt(tenant)
        if rng.random() < p.document_share:
            room = 4096  # the questions and answers of a few turns
            doc = self._item("document", tenant, self._documents.sample(rng), p.document_tokens_median,
                             p.document_tokens_sigma, p.max_prompt_tokens - system[1] - room)
            questions = int(rng.geometric(1.0 / p.questions_mean))
            qs = [lognormal_int(rng, p.question_tokens_median, 0.6, 8, 1000) for _ in range(questions)]
            answers = [lognormal_int(rng, p.answer_tokens_median, 0.6, 16, 2048) for _ in range(questions)]
            return self._capped(_chat_turns([system, doc], qs, answers, self.name, sid))
        repo = self._item("repo", tenant, self._repos.sample(rng), p.repo_tokens_median, p.repo_tokens_sigma,
                          p.max_prompt_tokens - system[1] - 8192)
        task = (segment_key(self.name, "task", sid), lognormal_int(rng, p.task_tokens_median, 0.6, 50, 4000), False)
        steps = int(rng.geometric(1.0 / p.agent_steps_mean))
        observations = [lognormal_int(rng, p.observation_tokens_median, 0.9, 20, 32_000) for _ in range(steps)]
        actions = [lognormal_int(rng, p.action_tokens_median, 0.6, 8, 2048) for _ in range(steps)]
        return self._capped(_chat_turns([system, repo], [task[1]] + observations[1:], actions, self.name, sid,
                                        [task]))

    def _capped(self, turns: list[Turn]) -> list[Turn]:
        """The turns up to the last whose prompt fits ``max_prompt_tokens`` (the first always does)."""
        out = []
        for turn in turns:
            if out and sum(seg[1] for seg in turn.segments) > self.params.max_prompt_tokens:
                break
            out.append(turn)
        return out


LONG_MIN_TOKENS = 32_768  # every shared document or repository is at least this long


def servable_prompt_tokens(cfg) -> int:
    """The longest prompt every worker of ``cfg`` (a ``ClusterConfig``) can serve with its answer:
    the model's context (``index.context_tokens``) or the smallest VRAM KV capacity, whichever is
    less, less the longest answer (2,048 tokens)."""
    vram = min((w.vram_kv_tokens for w in cfg.workers if w.vram_kv_tokens), default=cfg.index.context_tokens)
    return min(cfg.index.context_tokens, vram) - 2048
