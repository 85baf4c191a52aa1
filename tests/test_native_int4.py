"""int4 weights (compute_dtype="int4"): the numbers of a row never depend on what it is batched with."""

from __future__ import annotations

import pytest
import torch

import warmkv
from test_contract import check_warm_equals_cold

pytestmark = pytest.mark.skipif("native" not in warmkv.available_backends(), reason="torch not installed")


def test_int4_linear_rows_are_batch_invariant() -> None:
    from warmkv.backends.native.model import Linear

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
