"""Finding runs of a new prompt in the old resident tokens, past their exact common prefix.

    new: [0, r) exact prefix | gap | run (moved from old) | gap | run | ... | last token (never a run)

An index of the old tokens' k-grams gives candidate alignments; at each position of the
new tokens the longest extension of its k-gram's hits (at most MAX_HITS) is a match, and
the scan jumps past it, so the work is linear in the prompt in practice. Runs are then chosen
greedily, longest first; a candidate that overlaps a chosen run (in the old or the new
tokens) is trimmed to what is left, and kept if that is still long enough. Greedy is not
always the maximum cover, but it is within a small factor and ties to long runs, which
need fewer recomputed tokens.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

GRAM = 16  # the k of the k-gram index (chunk_min_tokens is >= 16)
MAX_HITS = 16  # positions kept per k-gram: repetitive text must not make the scan quadratic


@dataclass(frozen=True)
class Match:
    """new[new_start : new_start + length] == old[old_start : old_start + length]."""

    new_start: int
    old_start: int
    length: int

    @property
    def new_end(self) -> int:
        return self.new_start + self.length

    @property
    def old_end(self) -> int:
        return self.old_start + self.length


def find_runs(new: Sequence[int], old: Sequence[int], start: int, min_len: int) -> list[Match]:
    """Non-overlapping runs of new[start:-1] found in old[start:], each >= min_len, sorted by new_start.

    start is the exact common prefix: runs never reach back into it. The new prompt's last
    token is never part of a run: its logits must be computed.
    """
    if min_len < 1:
        raise ValueError(f"min_len must be >= 1, got {min_len}")
    end = len(new) - 1  # exclusive bound of what runs may cover in new
    k = min(GRAM, min_len)
    if end - start < min_len or len(old) - start < min_len:
        return []
    return _choose(_candidates(new, old, start, end, k, min_len), min_len)


def _candidates(new: Sequence[int], old: Sequence[int], start: int, end: int, k: int, min_len: int) -> list[Match]:
    index: dict[tuple[int, ...], list[int]] = {}
    for i in range(start, len(old) - k + 1):
        hits = index.setdefault(tuple(old[i : i + k]), [])
        if len(hits) < MAX_HITS:
            hits.append(i)
    found: list[Match] = []
    j = start
    while j <= end - k:
        best = Match(j, -1, 0)
        for i in index.get(tuple(new[j : j + k]), ()):
            n = k
            while j + n < end and i + n < len(old) and new[j + n] == old[i + n]:
                n += 1
            if n > best.length:
                best = Match(j, i, n)
        if best.length >= min_len:
            found.append(best)
            j = best.new_end  # the scan jumps past a match: linear in the prompt's length
        else:
            j += 1
    return found


def _choose(found: list[Match], min_len: int) -> list[Match]:
    heap = [(-m.length, m.new_start, m.old_start) for m in found]
    heapq.heapify(heap)
    chosen: list[Match] = []
    while heap:
        neg, j, i = heapq.heappop(heap)
        m = Match(j, i, -neg)
        pieces = _trim(m, chosen)
        if pieces == [m]:
            chosen.append(m)
            continue
        for p in pieces:
            if p.length >= min_len:
                heapq.heappush(heap, (-p.length, p.new_start, p.old_start))
    return sorted(chosen, key=lambda m: m.new_start)


def _trim(m: Match, chosen: Sequence[Match]) -> list[Match]:
    """The parts of m that overlap no chosen run, in the new tokens or in the old."""
    pieces = [m]
    for c in chosen:
        out: list[Match] = []
        for p in pieces:
            out.extend(_cut(p, c.new_start - p.new_start, c.new_end - p.new_start))
        pieces = []
        for p in out:
            pieces.extend(_cut(p, c.old_start - p.old_start, c.old_end - p.old_start))
    return pieces


def _cut(p: Match, lo: int, hi: int) -> list[Match]:
    """p without its offsets [lo, hi) (relative to its start)."""
    if hi <= 0 or lo >= p.length:
        return [p]
    out = []
    if lo > 0:
        out.append(Match(p.new_start, p.old_start, lo))
    if hi < p.length:
        out.append(Match(p.new_start + hi, p.old_start + hi, p.length - hi))
    return out
