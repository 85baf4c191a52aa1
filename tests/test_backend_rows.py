"""The forward row check both backends share: a bad row raises a typed error and changes nothing."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import warmkv
from conftest import BACKENDS
from warmkv.backends import Backend, load_backend
from warmkv.backends.base import ForwardRow

CFG = warmkv.RuntimeConfig(num_ctx=64, num_batch=16, num_ubatch=16, n_seq_max=2, kv_cache_type="f32")


@pytest.fixture(scope="module", params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> Iterator[Backend]:
    opts = {"compute_dtype": "float32"} if request.param == "native" else {}
    b = load_backend(request.param, str(warmkv.default_model_path()), CFG, **opts)
    yield b
    b.close()


BAD_ROWS = [
    ("wrong start", lambda s, o: [ForwardRow(s, [5], 1)], warmkv.InvalidInput, "starts at 1 but 3"),
    ("token out of vocab", lambda s, o: [ForwardRow(s, [49152], 3)], warmkv.InvalidInput, r"49152 out of range"),
    ("negative token", lambda s, o: [ForwardRow(s, [-1], 3)], warmkv.InvalidInput, "out of range"),
    ("past num_ctx", lambda s, o: [ForwardRow(s, [5] * 62, 3)], warmkv.ContextOverflow, "3 resident . 62 new"),
    ("unknown sequence", lambda s, o: [ForwardRow(99, [5], 0)], warmkv.InvalidInput, "99 out of range"),
    ("free sequence", lambda s, o: [ForwardRow(o, [5], 0)], warmkv.InvalidInput, "not acquired"),
    ("twice", lambda s, o: [ForwardRow(s, [5], 3), ForwardRow(s, [6], 4)], warmkv.InvalidInput, "twice"),
    ("empty", lambda s, o: [ForwardRow(s, [], 3)], warmkv.InvalidInput, "no tokens"),
    (
        "all_logits without logits",
        lambda s, o: [ForwardRow(s, [5, 6], 3, want_logits=False, all_logits=True)],
        warmkv.InvalidInput,
        "all_logits",
    ),
    ("not a row", lambda s, o: [(s, [5], 3)], warmkv.InvalidInput, "ForwardRow"),
]


@pytest.mark.parametrize(("name", "rows", "error", "match"), BAD_ROWS, ids=[r[0] for r in BAD_ROWS])
def test_bad_row_is_rejected_and_changes_nothing(backend: Backend, name: str, rows, error, match: str) -> None:
    seq = backend.acquire_seq()
    other = backend.acquire_seq()
    backend.release_seq(other)  # a valid id that is not acquired
    try:
        (before,) = backend.forward([ForwardRow(seq, [5, 6, 7], 0)])
        with pytest.raises(error, match=match):
            backend.forward(rows(seq, other))
        # The sequence is as it was: the next token continues at 3 and matches a fresh evaluation.
        (after,) = backend.forward([ForwardRow(seq, [8], 3)])
        backend.truncate(seq, 3)
        (again,) = backend.forward([ForwardRow(seq, [8], 3)])
        assert before is not None and after is not None and again is not None
        assert (after == again).all()
    finally:
        backend.release_seq(seq)
