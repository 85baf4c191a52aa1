"""Invariants of the prefix cache, checked by tests after random operation sequences."""

from __future__ import annotations

from itertools import pairwise
from typing import TYPE_CHECKING

from ..errors import CacheCorrupt

if TYPE_CHECKING:
    from .prefix_cache import PrefixCache, _Node


def _fail(msg: str) -> None:
    raise CacheCorrupt(f"prefix cache invariant broken: {msg}")


def check_cache(cache: PrefixCache) -> None:
    """Raise CacheCorrupt on the first broken invariant. The caller holds the cache lock."""
    entries, evictable = cache._entries, cache._evictable
    total = locked = 0
    for eid, e in entries.items():
        if e.id != eid or e._node is None:
            _fail(f"entry #{eid} is indexed but released or renumbered")
        if e._locks < 0:
            _fail(f"entry #{eid} has lock count {e._locks} < 0")
        if (e._locks == 0) != (eid in evictable):
            _fail(f"entry #{eid} with {e._locks} locks is {'' if eid in evictable else 'not '}in the LRU list")
        total += e.nbytes
        locked += e.nbytes if e._locks else 0
    for eid, e in evictable.items():
        if entries.get(eid) is not e:
            _fail(f"LRU list holds entry #{eid} which is not in the cache")
    ticks = [e._tick for e in evictable.values()]
    if any(a >= b for a, b in pairwise(ticks)):
        _fail(f"LRU list is not in access order: ticks {ticks}")
    if total != cache._bytes or locked != cache._locked_bytes:
        _fail(f"bytes {cache._bytes}/locked {cache._locked_bytes} != sum of entries {total}/{locked}")
    cap, max_n = cache.config.capacity_bytes, cache.config.max_entries
    if total > cap:
        _fail(f"{total} bytes cached > capacity {cap}")
    if max_n is not None and len(entries) > max_n:
        _fail(f"{len(entries)} entries > max_entries {max_n}")
    memberships = _check_tree(cache._root, entries)
    if memberships != sum(e.n_blocks for e in entries.values()):
        _fail(f"trie holds {memberships} entry memberships, entries have {sum(e.n_blocks for e in entries.values())}")
    for e in entries.values():
        node = e._node
        for depth in range(e.n_blocks, 0, -1):
            if node is None or node.depth != depth or node.key != e.keys[depth - 1] or e.id not in node.entries:
                _fail(f"entry #{e.id} path breaks at block {depth - 1}")
            node = node.parent
        if node is not cache._root:
            _fail(f"entry #{e.id} path does not end at the root")
    counters = (cache._hits, cache._misses, cache._hit_blocks, cache._inserts, cache._evictions)
    if min(counters) < 0:
        _fail(f"negative counter in {counters}")


def _check_tree(root: _Node, entries: dict) -> int:
    """Walk the trie; return the number of (node, entry) memberships."""
    memberships = 0
    stack = [root]
    while stack:
        node = stack.pop()
        for key, child in node.children.items():
            if child.parent is not node or child.key != key or child.depth != node.depth + 1:
                _fail(f"node {key[:12]} at depth {child.depth} has a broken parent link")
            if not child.entries:
                _fail(f"node {key[:12]} at depth {child.depth} is kept without entries")
            if node is not root and not child.entries.keys() <= node.entries.keys():
                _fail(f"node {key[:12]} has entries its parent lacks")
            for eid, e in child.entries.items():
                if entries.get(eid) is not e:
                    _fail(f"node {key[:12]} references released entry #{eid}")
            if child.end is not None and (child.end._node is not child or child.end.n_blocks != child.depth):
                _fail(f"node {key[:12]} ends entry #{child.end.id} which does not end there")
            memberships += len(child.entries)
            stack.append(child)
    if root.entries or root.end is not None:
        _fail("the root holds entries")
    return memberships
