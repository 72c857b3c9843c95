"""Prometheus series named like vLLM's (`conveyor:` prefix, labels model_name and replica).

Each LLM replica keeps the engine-side series of the requests it ran (`ReplicaMetrics`); each router
keeps the Serve-layer ones (`RouterMetrics`). Both are plain `dump`s (lists of families) that travel
with the stats a replica already pushes to the admission actor, so any router's /metrics renders
every source: a scrape through the Serve proxy sees the same series whichever router answers, and
no series is exported twice. Counters fed from the engine's cumulative stats are advanced by deltas
(reset-aware), and a departed replica's counters stay at their last value, so sums never go back."""

import time
from typing import Any, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.metrics_core import HistogramMetricFamily, Metric

from conveyor.engine.frontend.outputs import RequestOutput
from conveyor.engine.stats import ITERATION_TOKENS_BUCKETS, EngineStats

disable_created_metrics()

PREFIX = "conveyor:"
LABELS = ("model_name", "replica")
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1, 2.5, 5, 7.5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1, 2.5, 5, 10, 20)
REQUEST_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1, 1.5, 2, 2.5, 5, 10, 15, 20, 30, 40, 60, 120, 240, 480, 960)
OVERHEAD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)
Dump = list[dict[str, Any]]


def dump(registry: CollectorRegistry) -> Dump:
    """A registry's families as plain data (picklable, JSON-able): what a source pushes."""
    return [
        {
            "name": m.name,
            "type": m.type,
            "doc": m.documentation,
            "samples": [[s.name, dict(s.labels), s.value] for s in m.samples],
        }
        for m in registry.collect()
    ]


def counters_only(d: Dump) -> Dump:
    """What is kept of a departed source: its counters and histograms, not its gauges."""
    return [f for f in d if f["type"] != "gauge"]


class Merged:
    """A collector over several sources' dumps: one family per name, every source's samples in it."""

    def __init__(self, dumps: Iterable[Dump]) -> None:
        self.dumps = list(dumps)

    def collect(self) -> Iterable[Metric]:
        families: dict[str, Metric] = {}
        for d in self.dumps:
            for f in d:
                m = families.get(f["name"])
                if m is None:
                    m = families[f["name"]] = Metric(f["name"], f["doc"], f["type"])
                for name, labels, value in f["samples"]:
                    m.add_sample(name, labels, value)
        return families.values()


def render(dumps: Iterable[Dump]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(Merged(dumps))
    return generate_latest(registry)


def wall(monotonic_t: float) -> float:
    """An engine time.monotonic() stamp as wall-clock time, to compare across processes."""
    return time.time() - (time.monotonic() - monotonic_t)


class _IterationTokens:
    """`iteration_tokens_total` from the engine's cumulative per-step histogram, advanced by deltas."""

    def __init__(self, name: str, labels: dict[str, str]) -> None:
        self.name, self.labels = name, labels
        self.counts = [0] * (len(ITERATION_TOKENS_BUCKETS) + 1)
        self.sum, self._last_counts, self._last_sum = 0.0, [0] * len(self.counts), 0

    def update(self, counts: list[int], total: int) -> None:
        restarted = total < self._last_sum or any(c < p for c, p in zip(counts, self._last_counts))
        base, base_sum = ([0] * len(counts), 0) if restarted else (self._last_counts, self._last_sum)
        for i, (c, b) in enumerate(zip(counts, base)):
            self.counts[i] += c - b
        self.sum += total - base_sum
        self._last_counts, self._last_sum = list(counts), total

    def collect(self) -> Iterable[Metric]:
        h = HistogramMetricFamily(self.name, "Tokens scheduled per engine step", labels=list(self.labels))
        cumulative, buckets = 0, []
        for bound, c in zip([*map(str, ITERATION_TOKENS_BUCKETS), "+Inf"], self.counts):
            cumulative += c
            buckets.append((bound, cumulative))
        h.add_metric(list(self.labels.values()), buckets, self.sum)
        return [h]


class ReplicaMetrics:
    """Engine-side series of one LLM replica: live gauges and counters from EngineStats, per-request
    histograms from each RequestOutput's RequestMetrics (engine timestamps, time.monotonic)."""

    def __init__(self, model_name: str, replica: str) -> None:
        self.labels = {"model_name": model_name, "replica": replica}
        r = self.registry = CollectorRegistry(auto_describe=True)
        p, L = PREFIX, LABELS

        def hist(name: str, doc: str, buckets: tuple) -> Any:
            return Histogram(p + name, doc, L, buckets=buckets, registry=r).labels(**self.labels)

        self.running = Gauge(p + "num_requests_running", "Requests running in the engine", L, registry=r)
        self.waiting = Gauge(p + "num_requests_waiting", "Requests waiting (queued or swapped)", L, registry=r)
        self.kv_usage = Gauge(p + "kv_cache_usage_perc", "Fraction of KV-cache blocks in use (0-1)", L, registry=r)
        self.engine_counters = {
            "num_preemptions": Counter(p + "num_preemptions", "Preemptions", L, registry=r),
            "prefix_cache_queries": Counter(
                p + "prefix_cache_queries", "Prompt tokens looked up in the prefix cache", L, registry=r
            ),
            "prefix_cache_hits": Counter(
                p + "prefix_cache_hits", "Prompt tokens found in the prefix cache", L, registry=r
            ),
            "spec_decode_num_drafts": Counter(
                p + "spec_decode_num_drafts", "Speculative decoding: request-steps that carried drafts", L, registry=r
            ),
            "spec_decode_num_draft_tokens": Counter(
                p + "spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified", L, registry=r
            ),
            "spec_decode_num_accepted_tokens": Counter(
                p + "spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted", L, registry=r
            ),
        }
        self.accepted_per_pos = Counter(
            p + "spec_decode_num_accepted_tokens_per_pos",
            "Speculative decoding: draft tokens accepted at each draft position",
            L + ("position",),
            registry=r,
        )
        self.prompt_tokens = Counter(
            p + "prompt_tokens", "Prompt tokens of requests the engine started", L, registry=r
        ).labels(**self.labels)
        self.generation_tokens = Counter(p + "generation_tokens", "Tokens generated", L, registry=r).labels(
            **self.labels
        )
        self.success = Counter(
            p + "request_success", "Finished requests by finish reason", L + ("finished_reason",), registry=r
        )
        self.ttft = hist("time_to_first_token_seconds", "Engine arrival to first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Engine arrival to finish", REQUEST_BUCKETS)
        self.queue = hist("request_queue_time_seconds", "Engine arrival to first scheduled", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "First scheduled to first token", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "First token to last token", REQUEST_BUCKETS)
        T = L + ("tier",)
        self.tier_hits = Counter(p + "kv_tier_hits", "KV blocks loaded back from a lower tier", T, registry=r)
        self.tier_bytes = Counter(
            p + "kv_tier_bytes",
            "KV bytes moved into (stored) and out of (loaded) a lower tier",
            T + ("op",),
            registry=r,
        )
        self.tier_load_s = Counter(p + "kv_tier_load_seconds", "Time of the steps' tier loads", L, registry=r)
        self.tier_loads = Counter(p + "kv_tier_loads", "KV blocks loaded from the lower tiers", L, registry=r)
        self.iteration = _IterationTokens(p + "iteration_tokens_total", self.labels)
        r.register(self.iteration)
        self._last: dict[str, float] = {}
        self._seen: dict[str, tuple[float | None, int]] = {}

    def observe_output(self, out: RequestOutput) -> None:
        m, rid = out.metrics, out.request_id
        if m is None:
            return
        n = sum(len(c.token_ids) for c in out.outputs)
        if rid not in self._seen:
            self.prompt_tokens.inc(len(out.prompt_token_ids))
            self._seen[rid] = (None, 0)
        last_t, last_n = self._seen[rid]
        if n > last_n:
            self.generation_tokens.inc(n - last_n)
            if not last_n:
                last_t, last_n = m.first_token_time, 1
            if n > last_n and last_t is not None and m.last_token_time is not None:
                gap = (m.last_token_time - last_t) / (n - last_n)
                for _ in range(n - last_n):
                    self.itl.observe(gap)
            self._seen[rid] = (m.last_token_time, n)
        if not out.finished:
            return
        self._seen.pop(rid, None)
        reason = out.outputs[0].finish_reason or "stop"
        self.success.labels(**self.labels, finished_reason=reason).inc()
        if m.first_scheduled_time is not None:
            self.queue.observe(m.first_scheduled_time - m.arrival_time)
        if m.first_token_time is not None:
            self.ttft.observe(m.first_token_time - m.arrival_time)
            if m.first_scheduled_time is not None:
                self.prefill.observe(m.first_token_time - m.first_scheduled_time)
            if m.last_token_time is not None:
                self.decode.observe(m.last_token_time - m.first_token_time)
        if m.finish_time is not None:
            self.e2e.observe(m.finish_time - m.arrival_time)

    def observe_stats(self, s: EngineStats) -> None:
        self.running.labels(**self.labels).set(s.num_running)
        self.waiting.labels(**self.labels).set(s.num_waiting + s.num_swapped)
        self.kv_usage.labels(**self.labels).set(s.kv_cache_utilization)
        for key, counter in self.engine_counters.items():
            value, last = getattr(s, key), self._last.get(key, 0)
            counter.labels(**self.labels).inc(value - last if value >= last else value)
            self._last[key] = value
        self.iteration.update(s.iteration_tokens_counts, s.iteration_tokens_sum)
        for pos, value in enumerate(s.spec_decode_num_accepted_tokens_per_pos):
            key = f"spec_pos_{pos}"
            last = self._last.get(key, 0)
            self.accepted_per_pos.labels(**self.labels, position=str(pos)).inc(value - last if value >= last else value)
            self._last[key] = value
        for tier, hits in s.kv_tier_hits.items():
            stored, size = s.kv_tier_stored.get(tier, 0), s.kv_tier_block_bytes
            self._inc(self.tier_hits.labels(**self.labels, tier=tier), f"hits:{tier}", hits)
            self._inc(self.tier_bytes.labels(**self.labels, tier=tier, op="loaded"), f"lb:{tier}", hits * size)
            self._inc(self.tier_bytes.labels(**self.labels, tier=tier, op="stored"), f"sb:{tier}", stored * size)
        if s.kv_tier_hits:
            self._inc(self.tier_load_s.labels(**self.labels), "load_s", s.kv_tier_load_s)
            self._inc(self.tier_loads.labels(**self.labels), "loads", s.kv_tier_loads)

    def _inc(self, counter: Any, key: str, value: float) -> None:
        """A counter to a cumulative engine value (restarting if the value went down)."""
        last = self._last.get(key, 0)
        counter.inc(value - last if value >= last else value)
        self._last[key] = value

    def dump(self, stats: EngineStats | None = None) -> Dump:
        if stats is not None:
            self.observe_stats(stats)
        return dump(self.registry)


class RouterMetrics:
    """Serve-layer series of one router replica (label `router`): every HTTP response by endpoint and
    status, the HTTP duration, and `serve_overhead_seconds` split into ingress (router receipt to engine
    arrival) and egress (engine output to the bytes written). Admission's series stay router-local."""

    ENDPOINTS = ("/v1/completions", "/v1/chat/completions", "/v1/models", "/health", "/metrics", "/v1/cluster")
    current: "RouterMetrics | None" = None

    def __init__(self, model_name: str, router: str, roles: bool = False) -> None:
        """`roles`: a disaggregated app with admission per role; each admission decision then carries `role`."""
        self.model_name, self.router, self.roles = model_name, router, roles
        r = self.registry = CollectorRegistry()
        p = PREFIX
        self.http = Counter(
            p + "http_requests",
            "HTTP responses by endpoint and status",
            ["model_name", "router", "endpoint", "status"],
            registry=r,
        )
        self.duration = Histogram(
            p + "http_request_duration_seconds",
            "Router receipt to the last byte written",
            ["model_name", "router", "endpoint"],
            buckets=REQUEST_BUCKETS,
            registry=r,
        )
        self.overhead = Histogram(
            p + "serve_overhead_seconds",
            "Time in the Serve layer: ingress = router receipt "
            "to engine arrival, egress = engine output to the bytes written",
            ["model_name", "replica", "router", "phase"],
            buckets=OVERHEAD_BUCKETS,
            registry=r,
        )
        self.local = CollectorRegistry()
        self.admission = Counter(
            "conveyor_admission_decisions",
            "Admission decisions by outcome and reason (and role, in a disaggregated app)",
            ["admitted", "reason", *(["role"] if roles else [])],
            registry=self.local,
        )
        self.queued = Gauge(
            "conveyor_admission_queued", "Requests waiting for KV room at this router", registry=self.local
        )
        self.handoff_retries = Counter(
            "conveyor_handoff_retries",
            "KV handoffs sent to another decode replica, by why the last one failed (refused, lost)",
            ["reason"],
            registry=self.local,
        )
        self.sources: dict[str, Dump] = {}
        RouterMetrics.current = self

    def admission_decided(self, admitted: bool, reason: str, role: str = "prefill") -> None:
        more = {"role": role} if self.roles else {}
        self.admission.labels(admitted=str(admitted).lower(), reason=reason, **more).inc()

    def endpoint(self, path: str) -> str:
        return next((e for e in self.ENDPOINTS if path.endswith(e)), "other")

    def response(self, path: str, status: int) -> None:
        self.http.labels(self.model_name, self.router, self.endpoint(path), str(status)).inc()

    def request_done(self, endpoint: str, seconds: float) -> None:
        self.duration.labels(self.model_name, self.router, endpoint).observe(seconds)

    def serve_overhead(self, replica: str, phase: str, seconds: float) -> None:
        self.overhead.labels(self.model_name, replica, self.router, phase).observe(max(0.0, seconds))

    def dump(self) -> Dump:
        return dump(self.registry)

    def render(self, sources: dict[str, Dump] | None = None) -> bytes:
        """Every source's latest dump, then the router-local series. The router pushes its own dump to the
        shared `sources` before reading them, so whichever router answers a scrape, a counter never
        reads lower than an earlier scrape showed."""
        merged = {**self.sources, **(sources or {})}
        merged.setdefault(self.router, self.dump())
        return render(merged.values()) + generate_latest(self.local)


class ResponseCounter:
    """ASGI middleware: counts every response (validation 400s included) in `RouterMetrics.current`."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message: dict) -> None:
            if message["type"] == "http.response.start" and RouterMetrics.current is not None:
                RouterMetrics.current.response(scope.get("path", ""), message["status"])
            await send(message)

        await self.app(scope, receive, counted)
