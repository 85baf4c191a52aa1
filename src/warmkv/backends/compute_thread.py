"""One thread per process for everything that runs parallel kernels.

Both engines parallelize with OpenMP, and OpenMP keeps a thread pool per calling
thread. Once two pools exist (a server prefills on request threads and decodes on its
scheduler thread), the process has more OpenMP threads than cores, libgomp stops
spinning between parallel regions, and every small kernel then waits to wake a worker.
On a 2-core machine that made a decode step called from a second thread 2-3x slower
than the same step on the first (measured for llama.cpp and for torch alike). The two
engines load one libgomp (torch's and llama.cpp's share its soname), so a llama.cpp
model and a native one in the same process collide the same way: native decode ran at
half speed after a llama.cpp model had decoded. Routing all compute of every model
through one thread keeps one pool whoever calls. That includes work outside the engines
that runs parallel kernels: a llama-cpp-python `Llama` a benchmark runs beside warmkv
halved native decode (217 -> 103 tok/s) once it had generated on the main thread.
"""

from __future__ import annotations

import functools
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, Concatenate, ParamSpec, Protocol, TypeVar

P = ParamSpec("P")
R = TypeVar("R")

_Item = tuple[Future[Any], Callable[..., Any], tuple[Any, ...], dict[str, Any]]


_shared: dict[str, ComputeThread] = {}
_shared_lock = threading.Lock()


class ComputeThread:
    """A daemon thread that runs submitted calls one at a time, in order."""

    @classmethod
    def shared(cls, name: str) -> ComputeThread:
        """The process's thread of this name, started on first use and kept for the process."""
        with _shared_lock:
            ct = _shared.get(name)
            if ct is None or not ct._thread.is_alive():
                ct = _shared[name] = cls(name)
            return ct

    def __init__(self, name: str) -> None:
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def call(self, fn: Callable[P, R], /, *args: P.args, **kwargs: P.kwargs) -> R:
        """Run fn on the thread and return its result (its exception is raised here)."""
        if threading.current_thread() is self._thread or not self._thread.is_alive():
            return fn(*args, **kwargs)  # already there (a compute call that calls another), or stopped
        fut: Future[R] = Future()
        self._queue.put((fut, fn, args, kwargs))
        return fut.result()

    def stop(self) -> None:
        """Finish what was submitted, then end the thread (its OpenMP pool goes with it); calls then run in place."""
        if self._thread.is_alive():
            self._queue.put(None)
            if threading.current_thread() is not self._thread:
                self._thread.join()

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            fut, fn, args, kwargs = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                fut.set_result(fn(*args, **kwargs))
            except BaseException as e:  # handed to the caller, who re-raises it
                fut.set_exception(e)


def compute_thread() -> ComputeThread:
    """The process's compute thread: every model, and anything else that runs parallel kernels."""
    return ComputeThread.shared("warmkv-compute")


class HasCompute(Protocol):
    _compute: ComputeThread


S = TypeVar("S", bound=HasCompute)


def on_compute_thread(method: Callable[Concatenate[S, P], R]) -> Callable[Concatenate[S, P], R]:
    """Run a backend method on the backend's compute thread (`self._compute`)."""

    @functools.wraps(method)
    def wrapper(self: S, *args: P.args, **kwargs: P.kwargs) -> R:
        return self._compute.call(method, self, *args, **kwargs)

    return wrapper
