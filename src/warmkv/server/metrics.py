"""Prometheus metrics, one registry per app (several apps may live in one process)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from ..cache.remote.types import RemoteStats
from ..types import Usage

_TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("warmkv_requests", "HTTP requests", ["route", "status"], registry=r)
        self.prompt_tokens = Counter(
            "warmkv_prompt_tokens",
            "Prompt tokens by model and origin: prefilled now or reused from resident KV",
            ["model", "kind"],
            registry=r,
        )
        self.completion_tokens = Counter("warmkv_completion_tokens", "Generated tokens", ["model"], registry=r)
        self.draft_tokens = Counter(
            "warmkv_draft_tokens", "Speculative decoding: drafted tokens by outcome", ["model", "outcome"], registry=r
        )
        self.ttft = Histogram(
            "warmkv_ttft_seconds", "Time to first token", ["model"], buckets=_TTFT_BUCKETS, registry=r
        )
        self.errors = Counter("warmkv_errors", "Error responses by code", ["code"], registry=r)
        self.reused_fraction = Histogram(
            "warmkv_reused_fraction",
            "Fraction of each request's prompt tokens reused from resident KV",
            ["model"],
            buckets=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1.0),
            registry=r,
        )
        self.misses = Counter(
            "warmkv_cache_misses",
            "Requests whose reuse stopped before the end of the resident context, by the role of the message there",
            ["model", "role"],
            registry=r,
        )
        self._reused = 0
        self._prefilled = 0
        self.cache_hit_rate = Gauge(
            "warmkv_cache_hit_rate", "Reused / (reused + prefilled) prompt tokens since start", registry=r
        )
        self.cache_hit_rate.set_function(lambda: self._reused / max(1, self._reused + self._prefilled))

    def remote_tier(self, stats: Callable[[], list[tuple[str, RemoteStats]]]) -> None:
        """Export the remote KV tier's counters and rates (stats: each loaded model's, by model id)."""
        self.registry.register(_RemoteCollector(stats))

    def write_failures(self, counts: Callable[[], list[tuple[str, str, str, int]]]) -> None:
        """Export the writes the stores refused (counts: (model, kind, reason, n) for each)."""
        self.registry.register(_WriteFailures(counts))

    def gauge(self, name: str, doc: str, fn: Callable[[], float]) -> None:
        Gauge(name, doc, registry=self.registry).set_function(fn)

    def for_model(self, model: str) -> ModelMetrics:
        """The series of one model (each carries a `model` label)."""
        for outcome in ("accepted", "rejected"):  # every series is exported (as 0) from the model's load on
            self.draft_tokens.labels(model, outcome)
        for kind in ("reused", "prefilled"):
            self.prompt_tokens.labels(model, kind)
        self.completion_tokens.labels(model)
        return ModelMetrics(self, model)

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ModelMetrics:
    """One model's view of the server's metrics: what its requests observe, labelled with it."""

    def __init__(self, metrics: ServerMetrics, model: str) -> None:
        self.server, self.model = metrics, model

    def observe_prompt(self, reused: int, prefilled: int) -> None:
        m = self.server
        m._reused += reused
        m._prefilled += prefilled
        m.prompt_tokens.labels(self.model, "reused").inc(reused)
        m.prompt_tokens.labels(self.model, "prefilled").inc(prefilled)

    def observe_reuse(self, fraction: float) -> None:
        self.server.reused_fraction.labels(self.model).observe(fraction)

    def observe_ttft(self, seconds: float) -> None:
        self.server.ttft.labels(self.model).observe(seconds)

    def count_miss(self, role: str) -> None:
        self.server.misses.labels(self.model, role).inc()

    def count_error(self, code: str) -> None:
        self.server.errors.labels(code).inc()

    def observe_usage(self, usage: Usage | None) -> None:
        if usage is not None:
            m = self.server
            m.completion_tokens.labels(self.model).inc(usage.completion_tokens)
            m.draft_tokens.labels(self.model, "accepted").inc(usage.accepted_tokens)
            m.draft_tokens.labels(self.model, "rejected").inc(usage.draft_tokens - usage.accepted_tokens)


_REMOTE_COUNTS = (
    ("hits", "Prompts restored from the remote KV tier"),
    ("misses", "Remote KV tier probes that found nothing to read (or a value not served)"),
    ("declined", "Remote KV tier hits not read: prefilling was expected to be faster"),
    ("rejected", "Remote KV tier values dropped: bad crc, wrong size, manifest, tokens or fleet-key tag"),
    ("untrusted", "Remote KV tier values and session copies refused for a missing or wrong fleet-key tag"),
    ("written", "Entries written to the remote KV tier (written through, or spilled)"),
    ("present", "Entries the remote KV tier held already: neither copied nor sent again"),
    ("sessions_written", "Named sessions' copies written to the remote KV tier"),
    ("sessions_read", "Named sessions restored from the remote KV tier by a node that did not know them"),
    ("session_pieces_sent", "Pieces of named sessions' copies sent to the remote KV tier"),
    ("session_pieces_held", "Pieces of named sessions' copies the remote KV tier held already: not sent again"),
    ("session_bytes_sent", "Bytes of named sessions' copies sent to the remote KV tier"),
    ("skipped", "Remote KV tier operations not tried while the link was down"),
)


class _RemoteCollector(Collector):
    """The remote tier's counters as Prometheus counters, read from each model's stats at each scrape."""

    def __init__(self, stats: Callable[[], list[tuple[str, RemoteStats]]]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        models = self._stats()
        if not models:
            return
        errors = CounterMetricFamily(
            "warmkv_kv_remote_errors",
            "Remote KV tier operations that failed (refused, timed out, a server error), by operation",
            labels=["model", "op"],
        )
        for model, st in models:
            for op, n in (("probe", st.probe_errors), ("read", st.read_errors), ("write", st.write_errors)):
                errors.add_metric([model, op], n)
        yield errors
        for name, doc in _REMOTE_COUNTS:
            family = CounterMetricFamily(f"warmkv_kv_remote_{name}", doc, labels=["model"])
            for model, st in models:
                family.add_metric([model], getattr(st, name))
            yield family
        up = GaugeMetricFamily("warmkv_kv_remote_up", "1 while the remote KV tier answers, else 0", labels=["model"])
        for model, st in models:
            up.add_metric([model], st.up)
        yield up
        rates = (
            ("warmkv_kv_remote_read_bytes_per_second", "Remote KV tier read rate (EWMA of reads)", "read_bytes_per_s"),
            ("warmkv_kv_remote_rtt_seconds", "Remote KV tier round trip (EWMA of probes)", "rtt_s"),
            ("warmkv_prefill_tokens_per_second", "Prefill rate a remote read must beat", "prefill_tokens_per_s"),
        )
        for name, doc, attr in rates:
            family = GaugeMetricFamily(name, doc, labels=["model"])
            for model, st in models:
                if getattr(st, attr) is not None:
                    family.add_metric([model], getattr(st, attr))
            yield family


class _WriteFailures(Collector):
    """Writes the disk store and the stored responses refused, read from their counts at each scrape."""

    def __init__(self, counts: Callable[[], list[tuple[str, str, str, int]]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[Metric]:
        family = CounterMetricFamily(
            "warmkv_store_write_failures",
            "Writes a store refused, by kind (prefix, snapshot: the KV store; responses, conversations) and reason "
            "(no_space: the filesystem is full; over_budget: larger than the kind's budget; io); serving goes on",
            labels=["model", "kind", "reason"],
        )
        for model, kind, reason, n in self._counts():
            family.add_metric([model, kind, reason], n)
        yield family
