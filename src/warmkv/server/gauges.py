"""The server's gauges in /metrics: read from published stats and the loop's own state, never the model lock."""

from __future__ import annotations

from collections.abc import Callable

from ..cache.disk.store import KVStore
from ..cache.remote.types import RemoteStats
from .conversations.store import ResponseStore
from .state import Hub, ServerState

REMOTE_RESPONSES = (
    ("written", "Stored responses sent to the remote tier, since start"),
    ("read", "Stored responses read from the remote tier (kept by another node), since start"),
    ("deleted", "Stored responses deleted for every node (tombstones written), since start"),
    ("refused", "Stored responses the remote tier refused: deleted before they were sent, since start"),
    ("rejected", "Stored responses from the remote tier dropped for their seal, crc or id, since start"),
)


def register_gauges(hub: Hub) -> None:
    """Gauges read the published stats (warmkv.engine.stats) and the loop's own state: never the model lock.
    Each sums over the loaded models."""
    m = hub.metrics

    def total(fn: Callable[[ServerState], float]) -> Callable[[], float]:
        return lambda: sum(fn(st) for st in hub.table.states())

    m.gauge("warmkv_models_loaded", "Models loaded now", lambda: len(hub.table.loaded()))
    m.gauge("warmkv_model_swaps", "Loads that first unloaded another model (--models-max), since start",
            lambda: hub.table.swaps)  # fmt: skip
    m.gauge(
        "warmkv_resident_sessions",
        "Open sessions (server pool + /v1/sessions)",
        total(lambda st: st.runtime.stats.sessions),
    )
    m.gauge("warmkv_user_sessions", "Sessions opened through /v1/sessions", total(lambda st: len(st.registry)))
    m.gauge("warmkv_queue_depth", "Requests waiting for a session", lambda: hub.admission.waiting)
    m.gauge("warmkv_stored_responses", "Responses kept with store=true", lambda: hub.responses.stats()[0])
    m.gauge("warmkv_stored_response_bytes", "Bytes of stored responses", lambda: hub.responses.stats()[1])
    m.gauge("warmkv_conversations", "Conversations kept", lambda: hub.responses.conversations.stats()[0])
    m.gauge(
        "warmkv_conversation_bytes",
        "Bytes of conversations and their items",
        lambda: hub.responses.conversations.stats()[1],
    )
    shared = getattr(hub.responses, "remote_stats", None)  # shared through the remote tier (conversations/shared.py)
    for name, doc in REMOTE_RESPONSES if shared is not None else ():
        m.gauge(f"warmkv_stored_responses_remote_{name}", doc, lambda name=name: getattr(shared(), name))
    m.gauge(
        "warmkv_active_streams",
        "Turns on the scheduler (waiting or running)",
        total(lambda st: st.scheduler.stats.active),
    )
    m.gauge(
        "warmkv_scheduler_waiting_turns",
        "Turns whose prompt is not resident yet",
        total(lambda st: st.scheduler.stats.waiting),
    )
    m.gauge("warmkv_running_streams", "Turns decoding on the scheduler", total(lambda st: st.scheduler.stats.running))
    m.gauge(
        "warmkv_kv_held_tokens",
        "Tokens whose KV the pool holds now",
        total(lambda st: st.runtime.stats.kv_memory.held_tokens),
    )
    m.gauge(
        "warmkv_preempted_streams",
        "Turns waiting for KV pool room (preempted)",
        total(lambda st: st.scheduler.stats.preempted),
    )
    m.gauge(
        "warmkv_preemptions", "Turns preempted because the KV pool was short, since start",
        total(lambda st: st.scheduler.stats.preemptions),
    )  # fmt: skip
    m.gauge(
        "warmkv_parked_sessions", "Idle sessions whose KV moved to the tiers because the KV pool was short",
        total(lambda st: st.runtime.stats.parked),
    )  # fmt: skip
    m.gauge(
        "warmkv_decode_tokens_per_second",
        "Aggregate decode rate over the last 5 s",
        total(lambda st: st.scheduler.tokens_per_s()),
    )

    def pinned(tier: str, field: str) -> Callable[[ServerState], float]:
        def read(st: ServerState) -> float:
            tiers = st.runtime.tiers  # None once the runtime closed
            stats = tiers.tier_stats(tier) if tiers is not None else None
            return 0 if stats is None else stats[field]

        return read

    for name, tier, field, doc in (
        ("prefix_cache_pinned_bytes", "memory", "pinned_bytes", "Memory-tier bytes pinned by clients' cache hints"),
        ("prefix_cache_pinned_tokens", "memory", "pinned_tokens", "Tokens the memory tier's pinned entries hold"),
        ("kv_store_pins", "disk", "pins", "Prefixes pinned in the disk tier by long cache hints"),
        ("kv_store_pinned_bytes", "disk", "pinned_bytes", "Disk-tier bytes held by pins"),
        ("kv_store_pinned_tokens", "disk", "pinned_tokens", "Tokens the disk tier's pinned entries hold"),
    ):
        m.gauge(f"warmkv_{name}", doc, total(pinned(tier, field)))

    def write_failures() -> list[tuple[str, str, str, int]]:
        """(model, kind, reason, n) of each model's disk store, and of the stored responses (model "*")."""
        sources: list[tuple[str, KVStore | ResponseStore | None]] = [("*", hub.responses)]
        sources += [(st.model_id, getattr(st.runtime.tiers, "store", None)) for st in hub.table.states()]
        return [
            (model, kind, why, n)
            for model, store in sources
            if store is not None
            for kind, reasons in store.failures.counts().items()
            for why, n in reasons.items()
        ]

    m.write_failures(write_failures)

    def remote() -> list[tuple[str, RemoteStats]]:
        out = []
        for st in hub.table.states():
            tiers = st.runtime.tiers  # None once the runtime closed
            if tiers is not None and tiers.remote is not None:
                out.append((st.model_id, tiers.remote.stats()))
        return out

    m.remote_tier(remote)
