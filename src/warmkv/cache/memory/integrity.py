"""Invariants of the prefix cache, checked on a CacheState copy (taken by snapshot()) by tests after random
operation sequences."""

from __future__ import annotations

from collections.abc import Mapping
from itertools import pairwise
from typing import Any, NoReturn

from ...errors import CacheCorrupt
from .types import CacheEntry, CacheState, CacheStats, EntryState, NodeState


def _fail(msg: str) -> NoReturn:
    raise CacheCorrupt(f"prefix cache invariant broken: {msg}")


def check_cache(s: CacheState) -> None:
    """Raise CacheCorrupt on the first broken invariant of the snapshot s (PrefixCache.state())."""
    entries, in_lru = s.entries, {eid for eid, _ in s.lru}
    total = locked = 0
    for eid, e in entries.items():
        if e.id != eid or e.node is None:
            _fail(f"entry #{eid} is indexed but released or renumbered")
        if e.locks < 0:
            _fail(f"entry #{eid} has lock count {e.locks} < 0")
        if (e.locks == 0) != (eid in in_lru):
            _fail(f"entry #{eid} with {e.locks} locks is {'' if eid in in_lru else 'not '}in the LRU list")
        total += e.nbytes
        locked += e.nbytes if e.locks else 0
    for eid, e in s.lru:
        if entries.get(eid) is not e:
            _fail(f"LRU list holds entry #{eid} which is not in the cache")
    ticks = [e.tick for _, e in s.lru]
    if any(a >= b for a, b in pairwise(ticks)):
        _fail(f"LRU list is not in access order: ticks {ticks}")
    st = s.stats
    if total != st.bytes or locked != st.locked_bytes:
        _fail(f"bytes {st.bytes}/locked {st.locked_bytes} != sum of entries {total}/{locked}")
    if total > st.capacity_bytes:
        _fail(f"{total} bytes cached > capacity {st.capacity_bytes}")
    if s.max_entries is not None and len(entries) > s.max_entries:
        _fail(f"{len(entries)} entries > max_entries {s.max_entries}")
    memberships = _check_tree(s)
    if memberships != sum(e.n_blocks for e in entries.values()):
        _fail(f"trie holds {memberships} entry memberships, entries have {sum(e.n_blocks for e in entries.values())}")
    for e in entries.values():
        node = s.nodes.get(e.node) if e.node is not None else None
        for depth in range(e.n_blocks, 0, -1):
            if node is None or node.depth != depth or node.key != e.keys[depth - 1] or e.id not in node.entries:
                _fail(f"entry #{e.id} path breaks at block {depth - 1}")
            node = s.nodes.get(node.parent) if node.parent is not None else None
        if node is None or node.id != s.root:
            _fail(f"entry #{e.id} path does not end at the root")
    counters = (st.hits, st.misses, st.hit_blocks, st.inserts, st.evictions)
    if min(counters) < 0:
        _fail(f"negative counter in {counters}")
    _check_pins(s)


def _check_pins(s: CacheState) -> None:
    """Pins name live entries once each, their bytes are counted right and stay within the pin share."""
    ids = [eid for eid, _ in s.pins]
    if len(set(ids)) != len(ids):
        _fail(f"an entry is pinned twice: {ids}")
    pinned = blocks = 0
    for eid in ids:
        e = s.entries.get(eid)
        if e is None:
            _fail(f"pin on entry #{eid}, which is not in the cache")
        pinned += e.nbytes
        blocks += e.n_blocks
    if blocks != s.stats.pinned_blocks:
        _fail(f"pinned {s.stats.pinned_blocks} blocks != {blocks} in the pinned entries")
    if pinned != s.stats.pinned_bytes or len(ids) != s.stats.pinned_entries:
        _fail(f"pinned {s.stats.pinned_bytes} bytes in {s.stats.pinned_entries} entries != {pinned} in {len(ids)}")
    if pinned > s.pin_share * s.stats.capacity_bytes:
        _fail(f"{pinned} bytes pinned > pin share {s.pin_share} of {s.stats.capacity_bytes}")


def _check_tree(s: CacheState) -> int:
    """Walk the trie; return the number of (node, entry) memberships."""
    memberships = 0
    root = s.nodes[s.root]
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child_id in node.children.items():
            child = s.nodes.get(child_id)
            if child is None or child.parent != node.id or child.key != key or child.depth != node.depth + 1:
                _fail(f"node {key[:12]} under depth {node.depth} has a broken parent link")
            if not child.entries:
                _fail(f"node {key[:12]} at depth {child.depth} is kept without entries")
            if node is not root and not child.entries.keys() <= node.entries.keys():
                _fail(f"node {key[:12]} has entries its parent lacks")
            for eid, e in child.entries.items():
                if s.entries.get(eid) is not e:
                    _fail(f"node {key[:12]} references released entry #{eid}")
            end = child.end
            if end is not None and (end.node != child.id or end.n_blocks != child.depth):
                _fail(f"node {key[:12]} ends entry #{end.id} which does not end there")
            memberships += len(child.entries)
            stack.append(child)
    if root.entries or root.end is not None:
        _fail("the root holds entries")
    return memberships


def snapshot(
    root: Any,
    entries: dict[int, CacheEntry],
    lru: Mapping[int, CacheEntry],
    stats: CacheStats,
    max_entries: int | None,
    pins: tuple[tuple[int, float], ...] = (),
    pin_share: float = 1.0,
) -> CacheState:
    """Copy the trie and entries as they are linked, broken links included: check_cache judges them."""
    node_ids: dict[int, int] = {}
    seen: dict[int, EntryState] = {}

    def nid(node: object) -> int:
        return node_ids.setdefault(id(node), len(node_ids))

    def entry(e: CacheEntry) -> EntryState:
        if id(e) not in seen:
            node = None if e._node is None else nid(e._node)
            seen[id(e)] = EntryState(e.id, e.keys, e.nbytes, e._locks, e._tick, node)
        return seen[id(e)]

    nodes: dict[int, NodeState] = {}
    stack = [root]
    while stack:
        n = stack.pop()
        parent = None if n.parent is None else nid(n.parent)
        children = {k: nid(c) for k, c in n.children.items()}
        on_path = {k: entry(e) for k, e in n.entries.items()}
        end = None if n.end is None else entry(n.end)
        nodes[nid(n)] = NodeState(nid(n), n.key, n.depth, parent, children, on_path, end)
        stack.extend(n.children.values())
    indexed = {k: entry(e) for k, e in entries.items()}
    lru_state = tuple((k, entry(e)) for k, e in lru.items())
    return CacheState(indexed, lru_state, nodes, nid(root), stats, max_entries, pins, pin_share)
