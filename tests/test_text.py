"""UTF-8-safe streaming and stop strings, without a model."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from warmkv.prompt.text import StopMatcher, Utf8Stream


@given(st.text(), st.lists(st.integers(min_value=0, max_value=64), max_size=20))
def test_utf8_stream_never_splits_a_character(text: str, cuts: list[int]) -> None:
    data = text.encode()
    points = sorted({min(c, len(data)) for c in cuts} | {0, len(data)})
    stream = Utf8Stream()
    out = []
    for a, b in itertools.pairwise(points):
        piece = stream.push(data[a:b])
        assert "\ufffd" not in piece
        out.append(piece)
    out.append(stream.flush())
    assert "".join(out) == text


def test_utf8_stream_replaces_invalid_bytes() -> None:
    s = Utf8Stream()
    assert s.push(b"a\xffb") == "a\ufffdb"


@given(
    st.text(alphabet="abc</>", max_size=40),
    st.lists(st.text(alphabet="abc</>", min_size=1, max_size=4), min_size=1, max_size=3),
    st.lists(st.integers(min_value=0, max_value=40), max_size=8),
)
def test_stop_matcher_equals_batch_search(text: str, stops: list[str], cuts: list[int]) -> None:
    points = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    m = StopMatcher(stops)
    out, hit = [], False
    for a, b in itertools.pairwise(points):
        piece, hit = m.push(text[a:b])
        out.append(piece)
        if hit:
            break
    if not hit:
        tail, hit = m.flush()
        out.append(tail)
    hits = [i for i in (text.find(s) for s in stops) if i >= 0]
    expected = text[: min(hits)] if hits else text
    assert hit == bool(hits)
    assert "".join(out) == expected


def test_stop_matcher_holds_back_partial_match() -> None:
    m = StopMatcher(["</end>"])
    assert m.push("hello </e") == ("hello ", False)
    assert m.push("nd> more") == ("", True)
