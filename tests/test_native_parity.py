"""The native engine against transformers' reference implementation, on the same weights.

fp32 compute and fp32 KV: next-token logits must agree to 1e-3 (max abs diff) for one
sequence, a batch of sequences of different lengths, and a chunked prefill followed by
decode steps through the paged cache.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
from tokenizers import Tokenizer, models, pre_tokenizers

import warmkv
from warmkv.backends.base import ForwardRow
from warmkv.backends.native import NativeBackend
from warmkv.backends.native.load.gguf_loader import load_gguf
from warmkv.backends.native.load.tokenizer import _unicode_to_byte
from warmkv.bench.peers.hf_reference import transformers_llama

TOL = 1e-3
PARITY_CFG = warmkv.RuntimeConfig(num_ctx=256, num_batch=16, num_ubatch=16, n_seq_max=3, kv_cache_type="f32")


def hf_last_logits(model: transformers.PreTrainedModel, ids: list[int]) -> np.ndarray:
    with torch.inference_mode():
        return model(torch.tensor([ids])).logits[0, -1].float().numpy()


def write_byte_tokenizer(path: Path) -> None:
    vocab = {ch: b for ch, b in _unicode_to_byte().items()}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    tok.save(str(path / "tokenizer.json"))


def tiny_model(kind: str, path: Path) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    common = dict(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        initializer_range=0.1,  # larger than the default so logits are far from zero
        bos_token_id=None,
        eos_token_id=257,
    )
    if kind == "llama":
        rope = {"rope_type": "llama3", "rope_theta": 5000.0, "factor": 8.0, "low_freq_factor": 1.0}
        rope |= {"high_freq_factor": 4.0, "original_max_position_embeddings": 64}
        cfg = transformers.LlamaConfig(**common, rope_scaling=rope, tie_word_embeddings=False)
        model = transformers.LlamaForCausalLM(cfg)
    elif kind == "qwen2":
        cfg = transformers.Qwen2Config(**common, rope_theta=10000.0, tie_word_embeddings=True)
        model = transformers.Qwen2ForCausalLM(cfg)
        with torch.no_grad():  # random biases, so a wrong bias path cannot hide
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(0, 0.5)
    else:  # qwen3: per-head q/k RMSNorm, and a head_dim that is not hidden_size / heads
        cfg = transformers.Qwen3Config(**common, head_dim=32, rope_theta=10000.0, tie_word_embeddings=True)
        model = transformers.Qwen3ForCausalLM(cfg)
        with torch.no_grad():  # norm weights away from 1, so a skipped q/k norm cannot hide
            for layer in model.model.layers:
                layer.self_attn.q_norm.weight.uniform_(0.5, 1.5)
                layer.self_attn.k_norm.weight.uniform_(0.5, 1.5)
    model.eval()
    model.save_pretrained(str(path))
    write_byte_tokenizer(path)
    return model


Pair = tuple[NativeBackend, transformers.PreTrainedModel]


@pytest.fixture(scope="module", params=["gguf", "llama", "qwen2", "qwen3"])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pair]:
    if request.param == "gguf":
        path = warmkv.default_model_path()
        # float32 on the dequantized weights: the reference, whatever the default becomes
        backend = NativeBackend(str(path), PARITY_CFG, compute_dtype="float32")
        model = transformers_llama(load_gguf(path))  # raises unless every weight maps
    else:
        path = tmp_path_factory.mktemp(request.param)
        model = tiny_model(request.param, path)
        backend = NativeBackend(str(path), PARITY_CFG)
    yield backend, model
    backend.close()


def _ids(backend: NativeBackend, n: int, seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return rng.integers(3, backend.info.n_vocab, size=n).tolist()


def test_single_sequence(pair: Pair) -> None:
    backend, model = pair
    ids = _ids(backend, 37, 1)
    seq = backend.acquire_seq()
    try:
        (got,) = backend.forward([ForwardRow(seq, ids, 0)])
        diff = float(np.abs(got - hf_last_logits(model, ids)).max())
        assert diff <= TOL, f"max abs diff {diff:.2e}"
    finally:
        backend.release_seq(seq)


def test_batch_of_three_lengths(pair: Pair) -> None:
    backend, model = pair
    seqs = [backend.acquire_seq() for _ in range(3)]
    try:
        prompts = [_ids(backend, n, 10 + n) for n in (5, 23, 11)]
        outs = backend.forward([ForwardRow(s, p, 0) for s, p in zip(seqs, prompts, strict=True)])
        for got, ids in zip(outs, prompts, strict=True):
            assert got is not None
            diff = float(np.abs(got - hf_last_logits(model, ids)).max())
            assert diff <= TOL, f"length {len(ids)}: max abs diff {diff:.2e}"
    finally:
        for s in seqs:
            backend.release_seq(s)
        assert backend.cache is not None
        backend.cache.check_integrity()


def test_chunked_prefill_then_decode(pair: Pair) -> None:
    backend, model = pair
    ids = _ids(backend, 45, 3)  # 3 chunks of num_batch=16
    seq = backend.acquire_seq()
    worst = 0.0
    try:
        (got,) = backend.forward([ForwardRow(seq, ids, 0)])
        for _ in range(20):
            assert got is not None
            want = hf_last_logits(model, ids)
            worst = max(worst, float(np.abs(got - want).max()))
            ids = [*ids, int(np.argmax(want))]
            (got,) = backend.forward([ForwardRow(seq, ids[-1:], len(ids) - 1)])
    finally:
        backend.release_seq(seq)
    assert worst <= TOL, f"max abs diff over 20 decode steps {worst:.2e}"
