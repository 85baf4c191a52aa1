"""ComputeThread: every model's parallel kernels run on one thread, whoever calls."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

import warmkv
from warmkv.backends import load_backend
from warmkv.backends.base import ForwardRow
from warmkv.backends.compute_thread import ComputeThread
from warmkv.errors import InvalidInput, SessionFatal


def test_calls_from_many_threads_run_on_one_thread_in_order() -> None:
    ct = ComputeThread("test-compute")
    try:
        seen: list[tuple[int, int]] = []
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda i: ct.call(lambda: seen.append((i, threading.get_ident()))), range(40)))
        assert len(seen) == 40
        assert len({ident for _, ident in seen}) == 1
        assert seen[0][1] != threading.get_ident()
        order: list[int] = []
        for i in range(10):
            ct.call(order.append, i)
        assert order == list(range(10))
    finally:
        ct.stop()


def test_errors_reach_the_caller_typed_and_the_thread_goes_on() -> None:
    ct = ComputeThread("test-compute")
    try:

        def bad() -> None:
            raise InvalidInput("token id 99999 out of range [0, 49152)")

        with pytest.raises(InvalidInput, match="99999"):
            ct.call(bad)
        assert ct.call(lambda: 41 + 1) == 42
        # A compute call that calls another runs it in place instead of waiting on itself.
        assert ct.call(lambda: ct.call(lambda: "inner")) == "inner"
    finally:
        ct.stop()


def test_after_stop_calls_run_in_place() -> None:
    ct = ComputeThread("test-compute")
    ct.stop()
    assert ct.call(threading.get_ident) == threading.get_ident()


@pytest.mark.parametrize("name", warmkv.available_backends())
def test_backend_forward_runs_on_its_compute_thread(name: str) -> None:
    """Every model, of either engine, shares one compute thread; forwards from several threads agree."""
    cfg = warmkv.RuntimeConfig(num_ctx=128, n_seq_max=3)
    backend = load_backend(name, str(warmkv.default_model_path()), cfg)
    thread = backend._compute._thread  # type: ignore[attr-defined]
    for other in warmkv.available_backends():
        second = load_backend(other, str(warmkv.default_model_path()), cfg)
        second.close()
        assert second._compute._thread is thread, other  # type: ignore[attr-defined]
    try:
        ids = backend.tokenize("def add(a, b):\n    return a + b\n", add_bos=False, parse_special=False)

        lock = threading.Lock()  # the runtime's model lock serializes backend calls; so do we

        def run(_: int) -> list[float]:
            with lock:
                seq = backend.acquire_seq()
                try:
                    (logits,) = backend.forward([ForwardRow(seq, ids, 0)])
                    assert logits is not None
                    return logits[:8].tolist()
                finally:
                    backend.release_seq(seq)

        with ThreadPoolExecutor(3) as pool:
            outs = list(pool.map(run, range(3)))
        assert outs[0] == outs[1] == outs[2]
        assert thread.is_alive()
    finally:
        backend.close()
    assert thread.is_alive()  # kept for the next model of this engine
    with pytest.raises(SessionFatal, match="unloaded"):
        backend.forward([ForwardRow(0, [1], 0)])
