"""KeyMemo (cache/memory/key_memo.py) answers exactly what block_keys() and hash_token_ids() compute,
whatever prompts it remembers: continued, cut back, interleaved, under other salts or block sizes."""

from __future__ import annotations

import random

from warmkv.cache.memory.block_hash import block_keys
from warmkv.cache.memory.key_memo import KeyMemo
from warmkv.manifest import hash_token_ids

MANIFEST = "ab" * 32


def test_keys_and_digests_equal_the_full_computation() -> None:
    rng = random.Random(7)
    memo = KeyMemo(recent=3)
    convs = [[rng.randrange(49152) for _ in range(rng.randrange(0, 300))] for _ in range(4)]
    for step in range(400):
        i = rng.randrange(len(convs))
        tokens = convs[i]
        roll = rng.random()
        if roll < 0.6:  # the conversation goes on
            tokens += [rng.randrange(49152) for _ in range(rng.randrange(0, 90))]
        elif roll < 0.8 and tokens:  # cut back (a regenerated reply), then a new tail
            del tokens[rng.randrange(len(tokens)) :]
            tokens += [rng.randrange(49152) for _ in range(rng.randrange(0, 40))]
        block = rng.choice((16, 64))
        salt = rng.choice((None, None, "tenant-a"))
        given = tuple(tokens) if step % 2 else list(tokens)
        assert memo.keys(MANIFEST, given, block, salt) == block_keys(MANIFEST, tokens, block, salt), step
        assert memo.digest(given, block) == hash_token_ids(tokens), step
    assert memo.digest([], 64) == hash_token_ids([]) and memo.keys(MANIFEST, [], 64) == []
