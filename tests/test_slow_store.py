"""Disk I/O runs off the model lock: a running decode keeps producing tokens while the store works.

The store is the real SQLite store with every read and write slowed down by
DELAY_S; the model is the real default one. Under the old design (writes and
reads under the model lock) the decode stream produced no token in those windows.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import warmkv
import warmkv.engine.tiers
from conftest import USER_A
from warmkv.cache import KVStore

DELAY_S = 2.0
# Tokens the stream must produce inside each slowed store call. With the call under the
# model lock it makes at most one (a step that began before); an idle host makes dozens.
MIN_TOKENS = 2
# Two ~150-token prefixes sharing their first two 64-token blocks.
RULES = "<|im_start|>system\nYou review patches.\n" + "".join(f"Rule {i}: keep functions short.\n" for i in range(18))
PREFIX_A = RULES + "## a.py\ndef area(w, h):\n    return w * h\n<|im_end|>\n"
# A system prompt that keeps a stream decoding.
COUNT = "<|im_start|>system\nCount from one to a thousand, one number a line.<|im_end|>\n"
PREFIX_B = RULES + "## b.py\ndef perimeter(w, h):\n    return 2 * (w + h)\n<|im_end|>\n"


class SlowStore(KVStore):
    """KVStore whose put/get sleep first, recording when each call ran."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.windows: list[tuple[str, float, float]] = []

    def _slow(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        t0 = time.perf_counter()
        time.sleep(DELAY_S)
        try:
            return fn(*args, **kwargs)
        finally:
            self.windows.append((what, t0, time.perf_counter()))

    def put(self, *a: Any, **kw: Any) -> None:
        self._slow("put", super().put, *a, **kw)

    def put_snapshot(self, *a: Any, **kw: Any) -> Any:
        return self._slow("put_snapshot", super().put_snapshot, *a, **kw)

    def get_snapshot(self, *a: Any, **kw: Any) -> Any:
        return self._slow("get_snapshot", super().get_snapshot, *a, **kw)

    def longest_prefix(self, *a: Any, **kw: Any) -> Any:
        return self._slow("longest_prefix", super().longest_prefix, *a, **kw)


class Stream:
    """Decodes on its own thread until stopped, recording when each token arrived.

    It re-sends its suffix every 128 tokens, so it runs however fast the machine is.
    """

    def __init__(self, session: warmkv.Session) -> None:
        self.session = session
        self.times: list[float] = []
        self.error: BaseException | None = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 60
        while len(self.times) < 3 and time.monotonic() < deadline and self.error is None:
            time.sleep(0.01)
        assert len(self.times) >= 3, f"decode did not start: {self.error!r}"

    def _run(self) -> None:
        cfg = warmkv.DecodeConfig(max_tokens=128, temperature=0.0, ignore_eos=True)
        try:
            while not self._stopped.is_set():
                for chunk in self.session.decode(cfg):
                    self.times.extend([time.perf_counter()] * len(chunk.token_ids))
                self.session.prefill_suffix(USER_A)
        except BaseException as e:
            self.error = e

    def tokens_between(self, t0: float, t1: float) -> int:
        return sum(t0 <= t <= t1 for t in self.times)

    def rate(self) -> str:
        span = self.times[-1] - self.times[0]
        return f"stream: {len(self.times)} tokens at {(len(self.times) - 1) / span:.1f} tok/s overall"

    def stop(self) -> None:
        self._stopped.set()
        self.session.cancel()
        self._thread.join(30)
        assert not self._thread.is_alive()
        assert self.error is None


@pytest.fixture()
def rt(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[warmkv.Runtime]:
    monkeypatch.setattr(warmkv.engine.tiers, "KVStore", SlowStore)
    r = warmkv.Runtime.load(
        backend="llamacpp", num_ctx=2048, n_seq_max=4, kv_store_dir=str(tmp_path / "kv"), prefix_cache_mb=0
    )
    yield r
    r.close()


def streaming(rt: warmkv.Runtime) -> Stream:
    s = rt.session()
    s.ensure_prefix(COUNT)
    s.prefill_suffix(USER_A)
    return Stream(s)


def window(store: SlowStore, what: str, after: float) -> tuple[float, float]:
    """The first store call named `what` that started after `after`: (start, end)."""
    return next((t0, t1) for name, t0, t1 in store.windows if name == what and t0 >= after)


def test_snapshot_and_restore_io_do_not_stop_a_running_decode(rt: warmkv.Runtime) -> None:
    store: SlowStore = rt.tiers.store  # type: ignore[union-attr, assignment]
    with rt.session() as other:
        other.ensure_prefix(PREFIX_A)
        stream = streaming(rt)
        t0 = time.perf_counter()
        try:
            info = other.snapshot("slow")  # returns once durable: it waited for the slow write
            with rt.restore("slow") as restored:  # the slow read runs before the model lock is taken
                assert restored.explain().resident_tokens == info.n_tokens
        finally:
            stream.stop()
    assert info.n_tokens == len(rt.tokenize(PREFIX_A))
    write, read = window(store, "put_snapshot", t0), window(store, "get_snapshot", t0)
    during_write, during_read = stream.tokens_between(*write), stream.tokens_between(*read)
    print(
        f"tokens during a {write[1] - write[0]:.2f}s snapshot write: {during_write}; "
        f"during a {read[1] - read[0]:.2f}s snapshot read: {during_read}; {stream.rate()}"
    )
    assert during_write >= MIN_TOKENS and during_read >= MIN_TOKENS


def test_spills_and_disk_hits_do_not_stop_a_running_decode(rt: warmkv.Runtime) -> None:
    store: SlowStore = rt.tiers.store  # type: ignore[union-attr, assignment]
    stream = streaming(rt)
    t0 = time.perf_counter()
    try:
        with rt.session() as b:
            b.ensure_prefix(PREFIX_A)  # keeps its full blocks: queued for the slow writer, not written here
        with rt.session() as c:
            p = c.ensure_prefix(PREFIX_B)  # a disk hit, from the queue or (once written) the store
            assert p.reuse_source == "disk" and p.reused_tokens >= 2 * rt.config.cache_block_tokens
        assert rt.flush(60)
        t1 = time.perf_counter()
        with rt.session() as d:
            p = d.ensure_prefix(PREFIX_A)  # now read (slowly) from the store, without the model lock
            assert p.reuse_source == "disk"
    finally:
        stream.stop()
    put, read = window(store, "put", t0), window(store, "longest_prefix", t1)
    during_put, during_read = stream.tokens_between(*put), stream.tokens_between(*read)
    print(
        f"tokens during a {put[1] - put[0]:.2f}s spill write: {during_put}; "
        f"during a {read[1] - read[0]:.2f}s disk-tier read: {during_read}; {stream.rate()}"
    )
    assert during_put >= MIN_TOKENS and during_read >= MIN_TOKENS


def test_a_disk_hit_in_the_scheduler_does_not_stop_its_streams(rt: warmkv.Runtime) -> None:
    """The server's path: the scheduler reads a turn's disk hit on its reader thread, so the
    other streams keep their steps (read on the scheduler's own thread, they would all wait)."""
    from warmkv.engine.scheduler import Scheduler

    store: SlowStore = rt.tiers.store  # type: ignore[union-attr, assignment]
    with rt.session() as b:
        b.ensure_prefix(PREFIX_A)
    assert rt.flush(60)  # on disk: the next lookup reads the (slow) store
    scheduler = Scheduler(rt)
    try:
        with rt.session() as streaming, rt.session() as hitting:
            stamps: list[float] = []
            ended = threading.Event()

            def sink(chunk: warmkv.StreamChunk) -> None:
                stamps.extend([time.perf_counter()] * len(chunk.token_ids))
                if chunk.done:
                    ended.set()

            cfg = warmkv.DecodeConfig(max_tokens=1500, temperature=0.0, ignore_eos=True)
            scheduler.submit(streaming.turn(COUNT + USER_A, cfg), sink)
            deadline = time.monotonic() + 60
            while len(stamps) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
            t0 = time.perf_counter()
            got: list[object] = []
            resident = threading.Event()

            def prefilled(status: object) -> None:
                got.append(status)
                resident.set()

            one = warmkv.DecodeConfig(max_tokens=1, temperature=0.0)
            scheduler.submit(hitting.turn(PREFIX_A, one), lambda c: None, on_prefilled=prefilled)
            assert resident.wait(120)
            streaming.cancel()
            assert ended.wait(60)
        (status,) = got
        assert isinstance(status, warmkv.PrefixStatus) and status.reuse_source == "disk"
        read = window(store, "longest_prefix", t0)
        during = sum(read[0] <= t <= read[1] for t in stamps)
        print(f"stream tokens during a {read[1] - read[0]:.2f}s disk-tier read in the scheduler: {during}")
        assert during >= MIN_TOKENS
    finally:
        scheduler.close()


def test_a_turn_waiting_on_the_disk_does_not_hold_back_the_next_turns_prefill(rt: warmkv.Runtime) -> None:
    """With the step budget spent on decode rows, each step still prefills a piece of one waiting
    turn: the first that can go, not the first in line while its disk read is under way."""
    from warmkv.engine.scheduler import Scheduler, SchedulerConfig

    store: SlowStore = rt.tiers.store  # type: ignore[union-attr, assignment]
    with rt.session() as b:
        b.ensure_prefix(PREFIX_A)
    assert rt.flush(60)
    scheduler = Scheduler(rt, SchedulerConfig(max_step_tokens=1))  # one decode row spends it all
    try:
        with rt.session() as streaming, rt.session() as hitting, rt.session() as fresh:
            started = threading.Event()
            cfg = warmkv.DecodeConfig(max_tokens=1500, temperature=0.0, ignore_eos=True)
            scheduler.submit(streaming.turn(COUNT + USER_A, cfg), lambda c: started.set())
            assert started.wait(60)
            t0 = time.perf_counter()
            done: dict[str, float] = {}
            events = {name: threading.Event() for name in ("hitting", "fresh")}

            def on(name: str) -> Any:
                return lambda status: (done.setdefault(name, time.perf_counter()), events[name].set())

            one = warmkv.DecodeConfig(max_tokens=1, temperature=0.0)
            scheduler.submit(hitting.turn(PREFIX_A, one), lambda c: None, on_prefilled=on("hitting"))
            scheduler.submit(fresh.turn(USER_A, one), lambda c: None, on_prefilled=on("fresh"))
            assert events["hitting"].wait(120) and events["fresh"].wait(120)
            streaming.cancel()
        read = window(store, "longest_prefix", t0)
        print(
            f"disk read {read[0] - t0:.2f}-{read[1] - t0:.2f}s; the other turn prefilled at {done['fresh'] - t0:.2f}s"
        )
        assert done["fresh"] < read[1]
    finally:
        scheduler.close()


COPY_S = 2.0


def test_a_spills_copy_does_not_stop_a_running_decode(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The native engine's spill: the writer copies the kept blocks without the model lock.

    Both ways of copying are slowed; under the lock (the old design) the stream would stop.
    """
    from warmkv.backends.native.kv.pin import PinnedKV

    windows: list[tuple[float, float]] = []

    def slowed(fn: Any) -> Any:
        def copy(self: PinnedKV) -> Any:
            t0 = time.perf_counter()
            time.sleep(COPY_S)
            try:
                return fn(self)
            finally:
                windows.append((t0, time.perf_counter()))

        return copy

    monkeypatch.setattr(PinnedKV, "to_bytes", slowed(PinnedKV.to_bytes))
    monkeypatch.setattr(PinnedKV, "to_bytes_unlocked", slowed(PinnedKV.to_bytes_unlocked))
    opts = {"kv_store_dir": str(tmp_path / "kv"), "prefix_cache_mb": 0}
    with warmkv.Runtime.load(backend="native", num_ctx=2048, n_seq_max=4, **opts) as rt:
        stream = streaming(rt)
        try:
            with rt.session() as b:
                b.ensure_prefix(PREFIX_A)  # no memory tier: its full blocks spill at once
            assert rt.flush(60)
            with rt.session() as c:
                assert c.ensure_prefix(PREFIX_A).reuse_source == "disk"  # the copy was written
        finally:
            stream.stop()
        (window,) = windows
        during = stream.tokens_between(*window)
        print(f"tokens during a {window[1] - window[0]:.2f}s spill copy: {during}; {stream.rate()}")
        assert during >= MIN_TOKENS
