"""Many threads on one runtime at once: restore, fork, close, snapshot and decode never deadlock.

The lock order (warmkv.engine.runtime's module doc) is what this checks: every thread must
finish within its deadline, and the only errors allowed are typed warmkv errors
(SessionClosed when a shared session was closed under a call, SessionLimit when
every sequence is taken, ...).
"""

from __future__ import annotations

import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import warmkv
from conftest import USER_A, USER_B
from test_tiers import FILES_A, FILES_B, SYSTEM
from warmkv.errors import WarmkvError

RUN_S = 4.0  # every thread runs its operation this long, and past it until it has succeeded once
JOIN_S = 240.0  # past this a thread is taken as deadlocked (a loaded 2-core host is slow, not stuck)
DECODE = warmkv.DecodeConfig(max_tokens=6, temperature=0.0, ignore_eos=True)


class Shared:
    """Sessions that several threads use at once (and one thread closes and replaces)."""

    def __init__(self, rt: warmkv.Runtime, n: int) -> None:
        self._rt = rt
        self._lock = threading.Lock()
        self._sessions = [self._open() for _ in range(n)]

    def _open(self) -> warmkv.Session:
        s = self._rt.session()
        s.ensure_prefix(SYSTEM + FILES_B)
        return s

    def pick(self) -> warmkv.Session:
        with self._lock:
            return random.choice(self._sessions)

    def swap(self) -> None:
        """Close one shared session (others may be using it right now) and open a new one."""
        with self._lock:
            i = random.randrange(len(self._sessions))
            old = self._sessions[i]
        old.close()
        new = self._open()
        with self._lock:
            self._sessions[i] = new

    def close(self) -> None:
        for s in self._sessions:
            s.close()


def decode_some(s: warmkv.Session) -> None:
    for chunk in s.decode(DECODE):
        if chunk.error is not None:
            raise chunk.error


def test_restore_fork_close_snapshot_and_decode_at_once(tmp_path: Path) -> None:
    # A ~1,000-token prefix is ~20 MiB of llama.cpp state: the memory tier holds one, the other spills.
    rt = warmkv.Runtime.load(
        backend="llamacpp", num_ctx=1024, n_seq_max=8, kv_store_dir=str(tmp_path / "kv"), prefix_cache_mb=24
    )
    with rt.session() as base:
        base.ensure_prefix(SYSTEM + FILES_A)
        base.prefill_suffix(USER_A)
        base.snapshot("base")
    shared = Shared(rt, 2)
    done: Counter[str] = Counter()
    typed: Counter[str] = Counter()
    failures: list[str] = []
    stop = time.monotonic() + RUN_S

    def decoder() -> None:
        with rt.session() as s:
            s.ensure_prefix(SYSTEM + random.choice((FILES_A, FILES_B)))
            s.prefill_suffix(random.choice((USER_A, USER_B)))
            decode_some(s)

    def shared_decoder() -> None:
        s = shared.pick()
        s.prefill_suffix(USER_B)
        decode_some(s)

    def forker() -> None:
        child = shared.pick().fork()
        try:
            child.prefill_suffix(USER_A)
            decode_some(child)
        finally:
            child.close()

    def restorer() -> None:
        with rt.restore("base") as s:
            decode_some(s)

    def snapshotter() -> None:
        shared.pick().snapshot(f"snap-{random.randrange(3)}")

    def closer() -> None:
        shared.swap()
        time.sleep(0.2)

    def loop(name: str, op: Callable[[], None]) -> None:
        # The closer stops on time, so the others can finish the one success each must show.
        while time.monotonic() < stop or (not done[name] and name != "close" and time.monotonic() < stop + JOIN_S / 2):
            try:
                op()
                done[name] += 1
            except WarmkvError as e:
                typed[f"{name}: {type(e).__name__}"] += 1
            except BaseException:
                failures.append(f"{name}: {traceback.format_exc()}")
                return

    ops = {
        "decode": decoder,
        "shared_decode": shared_decoder,
        "fork": forker,
        "restore": restorer,
        "snapshot": snapshotter,
        "close": closer,
    }
    threads = [threading.Thread(target=loop, args=item, daemon=True, name=item[0]) for item in ops.items()]
    for t in threads:
        t.start()
    deadline = time.monotonic() + JOIN_S
    for t in threads:
        t.join(max(0.0, deadline - time.monotonic()))
    stuck = [t for t in threads if t.is_alive()]
    if stuck:
        frames = sys._current_frames()
        dump = "\n".join(f"{t.name}:\n{''.join(traceback.format_stack(frames[t.ident]))}" for t in stuck if t.ident)
        raise AssertionError(f"deadlocked threads after {JOIN_S:.0f}s:\n{dump}")
    assert not failures, "\n".join(failures)
    print(f"completed: {dict(done)}; typed errors: {dict(typed)}")
    assert all(done[name] for name in ops), f"an operation never completed: {dict(done)}, errors {dict(typed)}"

    shared.close()
    assert rt.flush(60)
    assert rt.tiers is not None and rt.tiers.store is not None
    assert rt.tiers.store.check_integrity()
    closer_thread = threading.Thread(target=rt.close, daemon=True)
    closer_thread.start()
    closer_thread.join(60)
    assert not closer_thread.is_alive(), "Runtime.close deadlocked"
