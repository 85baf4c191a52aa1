"""int4 weights (compute_dtype="int4"): the numbers of a row never depend on what it is batched with."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import warmkv
from test_contract import COPY_PROMPT, check_warm_equals_cold

pytestmark = pytest.mark.skipif("native" not in warmkv.available_backends(), reason="torch not installed")


def test_int4_linear_rows_are_batch_invariant() -> None:
    from warmkv.backends.native.model.linear import Linear

    torch.manual_seed(0)
    lin = Linear.make(torch.randn(256, 96), torch.bfloat16, "int4")
    assert lin.group == 32 and lin.w.dtype == torch.uint8  # packed, two codes a byte
    x = torch.randn(40, 96).bfloat16()
    whole = lin(x)
    assert torch.equal(whole, torch.cat([lin(x[i : i + 1]) for i in range(40)]))
    assert torch.equal(whole[:7], lin(x[:7]))
    odd = Linear.make(torch.randn(8, 40), torch.bfloat16, "int4")  # 40 inputs: no whole groups, int8 instead
    assert odd.group == 0 and odd.w.dtype == torch.int8


@pytest.mark.parametrize("kv", ["f16", "bf16"])  # bf16: decode rows read K/V through SDPA as stored
def test_int4_warm_turn_equals_cold_turn(kv: str) -> None:
    opts = {"prefix_cache_mb": 0, "kv_store_mb": 0, "backend_options": {"compute_dtype": "int4"}}
    with warmkv.Runtime.load(backend="native", num_ctx=1024, n_seq_max=2, kv_cache_type=kv, **opts) as rt:
        assert ("compute_dtype", "int4") in rt.manifest(True).numerics
        check_warm_equals_cold(rt)


def test_int4_speculative_output_is_plain_greedy() -> None:
    """int4 matmuls and the int8 head are batch invariant and verified drafts attend query by
    query, so speculation changes nothing in the output, bf16 attention included."""
    opts = {"prefix_cache_mb": 0, "kv_store_mb": 0, "backend_options": {"compute_dtype": "int4"}}
    with warmkv.Runtime.load(backend="native", num_ctx=1024, n_seq_max=1, kv_cache_type="bf16", **opts) as rt:
        outs = {}
        for k in (0, 3, 8):
            with rt.session() as s:
                s.ensure_prefix(COPY_PROMPT)
                cfg = warmkv.DecodeConfig(max_tokens=60, temperature=0, speculative=k)
                chunks = list(s.decode(cfg))
                outs[k] = [t for c in chunks for t in c.token_ids]
                if k:
                    assert chunks[-1].usage is not None and chunks[-1].usage.accepted_tokens > 0
        assert outs[3] == outs[0] and outs[8] == outs[0]


def test_auto_compute_dtype_runs_4bit_ggufs_as_int4(tmp_path: Path) -> None:
    """compute_dtype="auto": int4 where the file's layer weights are already Q4_0/Q4_1 codes."""
    from test_native_parity import tiny_model
    from warmkv.backends import load_backend
    from warmkv.backends.native.backend import resolve_compute_dtype

    cfg = warmkv.RuntimeConfig(num_ctx=128, n_seq_max=1)
    b = load_backend("native", str(warmkv.default_model_path()), cfg)  # SmolLM2 Q4_1; "auto" is the default
    try:
        assert b.numerics()["compute_dtype"] == "int4"
    finally:
        b.close()
    tiny_model("llama", tmp_path)  # float32 safetensors
    b = load_backend("native", str(tmp_path), cfg, compute_dtype="auto")
    try:
        assert b.numerics()["compute_dtype"] == "float32"
    finally:
        b.close()
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert resolve_compute_dtype("auto", frozenset({"Q4_0", "Q4_1"}), cpu) == "int4"
    assert resolve_compute_dtype("auto", frozenset({"Q4_1", "Q6_K"}), cpu) == "float32"  # mixed: no re-quantizing
    assert resolve_compute_dtype("auto", frozenset({"Q4_1"}), cuda) == "float32"  # int4 kernels are CPU only
    assert resolve_compute_dtype("bfloat16", frozenset({"Q4_1"}), cpu) == "bfloat16"


def test_int4_layers_come_from_the_files_codes_alone() -> None:
    """A Q4 GGUF's layer matrices go from its blocks straight to the kernels: the loader makes
    no float copy of them (a 3B model's layers alone would be 11 GB as float32)."""
    from warmkv.backends.native.cpp import decode_ext
    from warmkv.backends.native.load.checkpoint import Lazy
    from warmkv.backends.native.load.gguf_loader import load_gguf
    from warmkv.backends.native.model.transformer import Transformer

    ext = decode_ext.extension("auto")
    if ext is None:
        pytest.skip("the C++ kernels are not built here")
    ckpt = load_gguf(warmkv.default_model_path())
    made: list[str] = []

    def make(name: str) -> torch.Tensor:
        made.append(name)
        return ckpt.weights[name]

    weights = Lazy({k: ckpt.weights.shape(k) or () for k in ckpt.weights}, make)
    model = Transformer(ckpt.args, weights, torch.float32, 64, "int4", blocks=ckpt.blocks, ext=ext)
    assert "model.embed_tokens.weight" in made  # the embedding table is float32
    assert [n for n in made if n.endswith("_proj.weight")] == []
    assert all(x.qkind >= 0 for layer in model.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down))
