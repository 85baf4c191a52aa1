"""What `warmkv stats` reports of the state kept for users, each kind's count and bytes: on disk (the
KV store's prefix entries and snapshots, the stored responses and conversations beside it), or as a
running server reports it in /metrics (every kind, in memory too: parked sessions, stored reasoning,
the memory tier, remote copies)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..cache import KVStore
from ..errors import WarmkvError

SESSION_PREFIX = "session-"  # the server's snapshots of /v1/sessions sessions (unloads, drains)
RESPONSES_FILE = "responses.sqlite3"  # beside the KV store (cli/serve.py)


@dataclass(frozen=True)
class KeptRow:
    kind: str
    model: str  # "*": not one model's (parked sessions, stored responses); "" on disk: any model's
    count: int
    bytes: int
    budget_bytes: int | None = None
    note: str = ""


def on_disk(store: KVStore) -> list[KeptRow]:
    """The kinds a store directory holds (no server needed)."""
    st, cfg = store.stats(), store.config
    sessions = [s for s in store.list_snapshots() if s.name.startswith(SESSION_PREFIX)]
    rows = [
        KeptRow("disk_prefixes", "", st.entries, st.entry_bytes, cfg.capacity_bytes - cfg.snapshot_budget),
        KeptRow(
            "snapshots", "", st.snapshots, st.snapshot_bytes, cfg.snapshot_budget,
            f"{len(sessions)} of them sessions' ({sum(s.size for s in sessions):,} bytes)",
        ),
    ]  # fmt: skip
    path = Path(store.directory) / RESPONSES_FILE
    if path.exists():
        rows += _responses(path)
    return rows


def _responses(path: Path) -> list[KeptRow]:
    """Stored responses and conversations, from the server's file (read through its own store)."""
    try:
        from ..server.conversations.store import ResponseStore
    except ImportError as e:  # the file was written by a server: its extra was installed then
        return [KeptRow("stored_responses", "*", 0, 0, note=f"not read: {e}")]
    store = ResponseStore(path)
    try:
        (n, size), (cn, csize) = store.stats(), store.conversations.stats()
        cap = store.limits.max_bytes
    finally:
        store.close()
    note = "one budget for both (--responses-mb)"
    return [KeptRow("stored_responses", "*", n, size, cap, note), KeptRow("conversations", "*", cn, csize, cap, note)]


def on_server(url: str, api_key: str | None = None) -> tuple[list[KeptRow], list[tuple[str, str, str, float]]]:
    """Every kind a running server keeps (warmkv_kept_* in its /metrics), and its refused writes
    (model, kind, reason, count)."""
    try:
        import httpx
        from prometheus_client.parser import text_string_to_metric_families
    except ImportError as e:
        raise WarmkvError(f"--server needs the server extra ({e}): pip install 'warmkv[server]'") from None
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(url.rstrip("/") + "/metrics", headers=headers, timeout=10)
    except httpx.HTTPError as e:
        raise WarmkvError(f"cannot read {url}/metrics: {e}") from None
    if r.status_code != 200:
        raise WarmkvError(f"{url}/metrics answered {r.status_code}: {r.text[:200]}")
    values: dict[str, dict[tuple[str, str], float]] = {"items": {}, "bytes": {}, "budget_bytes": {}}
    failures: list[tuple[str, str, str, float]] = []
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            if s.name.startswith("warmkv_kept_") and s.name[len("warmkv_kept_") :] in values:
                values[s.name[len("warmkv_kept_") :]][(s.labels["kind"], s.labels["model"])] = s.value
            elif s.name == "warmkv_store_write_failures_total":
                failures.append((s.labels["model"], s.labels["kind"], s.labels["reason"], s.value))
    rows = []
    for (kind, model), count in sorted(values["items"].items()):
        budget = values["budget_bytes"].get((kind, model))
        size = int(values["bytes"].get((kind, model), 0))
        rows.append(KeptRow(kind, model, int(count), size, None if budget is None else int(budget)))
    return rows, failures
