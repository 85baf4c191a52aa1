"""Shared fixtures: real runtimes on the real default model, one per backend."""

from __future__ import annotations

import os

# Before warmkv is imported (it reads it once): every context is checked after every scheduler and
# decode step, in the tests and in the servers and commands they start.
os.environ.setdefault("WARMKV_CHECK", "1")

from collections.abc import Iterator

import pytest

import warmkv
from context_checks import ContextChecks
from redis_server import redis_server  # noqa: F401  (a fixture: a real redis-server per test module)

BACKENDS = [b for b in ("llamacpp", "native") if b in warmkv.available_backends()]
# The contract suite checks reuse of a session's own resident KV, exactly; the
# shared memory and disk tiers have their own tests (test_tiers.py).
NO_TIERS = {"prefix_cache_mb": 0, "kv_store_mb": 0}


@pytest.fixture(scope="session", autouse=True)
def _private_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Keep every store the tests open (CLI included) out of the user's cache dir."""
    mp = pytest.MonkeyPatch()
    mp.setenv("WARMKV_CACHE_DIR", str(tmp_path_factory.mktemp("warmkv-cache")))
    yield
    mp.undo()


@pytest.fixture(scope="session")
def harness_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """One `warmkv serve` that every agent-CLI test shares (harness_common.py)."""
    common = pytest.importorskip("harness_common")  # it needs httpx and the server extra
    yield from common.serving(tmp_path_factory)


@pytest.fixture
def checked_contexts(monkeypatch: pytest.MonkeyPatch) -> Iterator[ContextChecks]:
    """Check every session's resident context after each of its operations and steps (Session's and
    the Scheduler's): a module opts in with pytestmark = pytest.mark.usefixtures("checked_contexts")."""
    checks = ContextChecks(monkeypatch)
    yield checks
    assert not checks.failures, "\n".join(checks.failures)


@pytest.fixture(scope="session", params=BACKENDS)
def rt(request: pytest.FixtureRequest) -> Iterator[warmkv.Runtime]:
    """A runtime per backend with a small context (fast tests) and 4 session slots."""
    runtime = warmkv.Runtime.load(backend=request.param, num_ctx=1024, n_seq_max=4, **NO_TIERS)
    yield runtime
    runtime.close()


@pytest.fixture(scope="session", params=BACKENDS)
def tiny_rt(request: pytest.FixtureRequest) -> Iterator[warmkv.Runtime]:
    """A runtime with a 96-token context, to reach overflow quickly."""
    runtime = warmkv.Runtime.load(backend=request.param, num_ctx=96, n_seq_max=2, **NO_TIERS)
    yield runtime
    runtime.close()


GREEDY = warmkv.DecodeConfig(max_tokens=16, temperature=0.0)


def greedy_tokens(session: warmkv.Session, max_tokens: int = 16) -> list[int]:
    """Decode greedily and return the generated token ids (errors re-raised)."""
    tokens: list[int] = []
    for chunk in session.decode(warmkv.DecodeConfig(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)):
        if chunk.error is not None:
            raise chunk.error
        tokens.extend(chunk.token_ids)
    return tokens


SYSTEM = (
    "<|im_start|>system\nYou are a concise assistant for a Python repository. "
    "The repository has a module utils.py with a function add(a, b) that returns a + b, "
    "and a test file test_utils.py that checks add(2, 3) == 5.<|im_end|>\n"
)
USER_A = "<|im_start|>user\nWhat does add(2, 3) return?<|im_end|>\n<|im_start|>assistant\n"
USER_B = "<|im_start|>user\nName the test file.<|im_end|>\n<|im_start|>assistant\n"
