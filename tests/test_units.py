"""Config, manifest and sampling units, without a model."""

from __future__ import annotations

import numpy as np
import pytest

import warmkv
from warmkv.backends import LlamaCppOptions, NativeOptions, make_options
from warmkv.config import ResolvedConfig, RuntimeConfig
from warmkv.manifest import ContextManifest
from warmkv.prompt.sampling import Sampler


def _manifest(**over: object) -> ContextManifest:
    args = dict(
        model_digest="m",
        tokenizer_digest="t",
        chat_template="tpl",
        numerics={"kv_cache_type": "f16"},
        add_bos=False,
        backend="llamacpp",
    )
    args.update(over)
    return ContextManifest.build(**args)  # type: ignore[arg-type]


def test_manifest_digest_covers_every_numerics_input() -> None:
    base = _manifest()
    assert base.digest == _manifest().digest
    for change in (
        {"model_digest": "m2"},
        {"tokenizer_digest": "t2"},
        {"chat_template": "other"},
        {"numerics": {"kv_cache_type": "q8_0"}},
        {"add_bos": True},
        {"backend": "native"},
    ):
        other = _manifest(**change)
        assert other.digest != base.digest
        assert base.diff(other)
        with pytest.raises(warmkv.ManifestMismatch):
            base.require_equal(other, "test")


def test_segments_do_not_change_identity() -> None:
    base = _manifest()
    seg = base.with_segments((warmkv.Segment("system", 0, 10),))
    assert seg == base and seg.digest == base.digest
    assert seg.to_dict()["segments"] == [{"name": "system", "start": 0, "end": 10}]


def test_bad_segments() -> None:
    with pytest.raises(warmkv.InvalidInput):
        warmkv.Segment("x", 5, 2)
    with pytest.raises(warmkv.InvalidInput):
        warmkv.Segment("", 0, 1)


def test_hash_token_ids_is_order_sensitive() -> None:
    assert warmkv.hash_token_ids([1, 2, 3]) != warmkv.hash_token_ids([3, 2, 1])
    assert warmkv.hash_token_ids([]) == warmkv.hash_token_ids(())


def test_runtime_config_resolves_auto() -> None:
    cfg = RuntimeConfig().resolved(n_ctx_train=8192)
    assert cfg.num_ctx == 4096 and cfg.num_threads and cfg.flash_attn == "off"
    assert RuntimeConfig(kv_cache_type="q8_0").resolved(n_ctx_train=512).flash_attn == "on"
    assert RuntimeConfig(kv_cache_type="q8_0").resolved(n_ctx_train=512).num_ctx == 512
    with pytest.raises(AttributeError):
        cfg.num_ctx = 5  # type: ignore[misc]
    assert isinstance(cfg, ResolvedConfig) and isinstance(cfg, RuntimeConfig)
    assert cfg.resolved(n_ctx_train=16) is cfg  # already concrete
    with pytest.raises(warmkv.InvalidConfig, match="flash_attn"):
        ResolvedConfig(flash_attn="auto")


def test_backend_options_are_validated_records() -> None:
    assert make_options("native") == NativeOptions()
    opts = make_options("native", {"compute_dtype": "int4"}, device="cpu")
    assert opts == NativeOptions(compute_dtype="int4", device="cpu")
    assert make_options("native", opts, kv_cache_mb=64) == NativeOptions("int4", "cpu", "auto", 64)
    assert make_options("llamacpp", use_mlock=True) == LlamaCppOptions(use_mlock=True)
    bad = [
        (lambda: NativeOptions(compute_dtype="float8"), "compute_dtype must be one of auto, float32"),
        (lambda: NativeOptions(device="gpu"), "device must be 'cpu', 'cuda', 'cuda:N' or 'auto'; got 'gpu'"),
        (lambda: NativeOptions(cpp_decode="yes"), "cpp_decode"),
        (lambda: NativeOptions(kv_cache_mb=0), "kv_cache_mb must be a positive integer, got 0"),
        (lambda: LlamaCppOptions(use_mmap="no"), "use_mmap must be a bool"),  # type: ignore[arg-type]
        (lambda: make_options("llamacpp", compute_dtype="int4"), r"'llamacpp' has no option\(s\) \['compute_dtype'\]"),
        (lambda: make_options("native", LlamaCppOptions()), "takes NativeOptions, got LlamaCppOptions"),
    ]
    for make, match in bad:
        with pytest.raises(warmkv.InvalidConfig, match=match):
            make()
    with pytest.raises(AttributeError):
        opts.device = "cuda"  # type: ignore[misc]


def test_sampler_greedy_and_seeded() -> None:
    rng = np.random.default_rng(0)
    logits = rng.normal(size=1000).astype(np.float32)
    assert Sampler(warmkv.DecodeConfig(temperature=0.0)).sample(logits) == int(np.argmax(logits))
    cfg = warmkv.DecodeConfig(temperature=1.0, top_k=50, top_p=0.9, min_p=0.01, seed=7)
    a = [Sampler(cfg).sample(logits) for _ in range(3)]
    assert len(set(a)) == 1  # same seed, same draw
    top50 = set(np.argsort(-logits)[:50].tolist())
    draws = Sampler(cfg)
    assert all(draws.sample(logits) in top50 for _ in range(200))


def test_repeat_penalty_discourages_history() -> None:
    logits = np.array([2.0, 1.9, 0.0], dtype=np.float32)
    cfg = warmkv.DecodeConfig(temperature=0.0, repeat_penalty=1.5)
    assert Sampler(cfg).sample(logits, history=[0]) == 1


def test_decode_config_accepts_lists_and_strings() -> None:
    cfg = warmkv.DecodeConfig(stop="END", stop_token_ids=[2])
    assert cfg.stop == ("END",) and cfg.stop_token_ids == (2,)
    hash(cfg)


def test_seq_slots_reserve_one_for_the_runtime() -> None:
    from warmkv.backends.slots import SeqSlots

    slots = SeqSlots(2)
    helper = slots.acquire_internal()
    a, b = slots.acquire(), slots.acquire()  # both session slots stay usable after the helper took its own
    assert len({helper, a, b}) == 3
    with pytest.raises(warmkv.SessionLimit, match="n_seq_max=2"):
        slots.acquire()
    slots.release(a)
    assert slots.acquire() == a
    slots.check(b)
    with pytest.raises(warmkv.InvalidInput):
        slots.check(7)
    slots.release(b)
    with pytest.raises(warmkv.InvalidInput, match="not acquired"):
        slots.check(b)


def test_lookup_draft_follows_the_latest_earlier_occurrence() -> None:
    from warmkv.prompt.tokens import lookup_draft

    assert lookup_draft([1, 2, 3, 4, 5, 6, 1, 2, 3], 3) == [4, 5, 6]
    assert lookup_draft([1, 2, 3, 4, 5, 6, 1, 2, 3], 10) == [4, 5, 6, 1, 2, 3]  # runs up to the end
    assert lookup_draft([9, 1, 2, 7, 1, 2, 8, 1, 2], 2) == [8, 1]  # the latest occurrence wins
    assert lookup_draft([5, 6, 7, 1, 2, 3, 4, 2, 3, 4], 2) == [2, 3]  # longest n-gram first: 2,3,4 -> 2,3
    assert lookup_draft([1, 2, 3], 4) == [] and lookup_draft([5], 3) == [] and lookup_draft([], 3) == []


def test_template_keeps_a_bos_the_runtime_does_not_add() -> None:
    from warmkv.prompt.chat import CHATML, ChatTemplate

    msgs = [{"role": "user", "content": "hi"}]
    # SmolLM2's BOS is <|im_start|>, which its template writes first: without a BOS policy it must stay.
    kept = ChatTemplate(CHATML, bos_token="<|im_start|>", adds_bos=False).render(msgs)
    assert kept.startswith("<|im_start|>user\nhi")
    dropped = ChatTemplate("{{ bos_token }}" + CHATML, bos_token="<s>", adds_bos=True).render(msgs)
    assert dropped.startswith("<|im_start|>user")  # the runtime prepends <s> itself: no double BOS
