"""A model's matrices and layers: Linear (float, int8, int4 or qmatmul's packed blocks) and Layer.

Apart from the model because a load cache stores and restores them as they are, without the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType

import torch
import torch.nn.functional as F

from ..load.qweights import KINDS, Blocks
from ..load.weight_arena import WeightArena

INT4_GROUP = 32  # Q4_0/Q4_1's block: a GGUF's own 4-bit codes come back exactly


@dataclass(frozen=True)
class Linear:
    """y = x W^T + b, W float or weight-only quantized.

    int8: a scale per output row. int4 with the C++ kernels (`ext`): blocks of 32 packed for
    qmatmul (csrc/qmatmul.h), `qkind` >= 0, plus an optional bfloat16 copy `dense` that
    prefill rows multiply by (prefill_weights="bf16": on CPUs without int8 dot products).
    int4 without them: torch's CPU int4 kernel (groups with a scale and a minimum each);
    `scale` then holds [in/32, out, 2] (scale, zero) as it wants them.
    """

    w: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    group: int = 0  # torch int4 group size, 0 otherwise
    qkind: int = -1  # qmatmul's kind (0 Q4_0, 1 Q4_1, 2 Q8_0) when w holds its packed blocks
    n: int = 0  # outputs, when qkind >= 0 (w's rows are padded to tiles)
    dense: torch.Tensor | None = None
    ext: ModuleType | None = None

    @staticmethod
    def make(
        w: torch.Tensor,
        dtype: torch.dtype,
        quant: str = "none",
        bias: torch.Tensor | None = None,
        device: torch.device | None = None,
    ) -> Linear:
        """Quantized weights (int8, int4) run on torch's CPU kernels: `device` is for float weights."""
        b = None if bias is None else bias.to(device=device, dtype=dtype)
        if quant == "none":
            return Linear(w.to(device=device, dtype=dtype).contiguous(), b)
        if quant == "int4" and w.shape[1] % INT4_GROUP == 0:
            return Linear._int4(w.float(), dtype, b)
        # Decode is memory-bound: int8 rows read 4x fewer bytes than float32.
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return Linear(q, b, scale.to(dtype))

    @staticmethod
    def blocks(blocks: Blocks, arena: WeightArena, bias: torch.Tensor | None, dense: bool) -> Linear:
        """qmatmul's packed blocks, placed in the model's arena; dense: also keep a bfloat16 copy
        for prefill rows."""
        w = blocks.dequantize().to(torch.bfloat16) if dense else None
        packed = arena.place(blocks.pack())
        return Linear(packed, bias, qkind=KINDS[blocks.kind], n=blocks.shape[0], dense=w, ext=arena.ext)

    @staticmethod
    def _int4(w: torch.Tensor, dtype: torch.dtype, bias: torch.Tensor | None) -> Linear:
        n, k = w.shape
        groups = w.reshape(n, k // INT4_GROUP, INT4_GROUP)
        lo = groups.amin(dim=-1)
        step = ((groups.amax(dim=-1) - lo) / 15).clamp_min(1e-12)
        q = torch.round((groups - lo[..., None]) / step[..., None]).clamp(0, 15).to(torch.int32).reshape(n, k)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        # The kernel computes (q - 8) * scale + zero.
        scale_zero = torch.stack((step.t(), (lo + 8 * step).t()), dim=-1).to(dtype).contiguous()
        return Linear(packed, bias, scale_zero, INT4_GROUP)

    def __call__(self, x: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """prefill: the row kind; it picks the kernel (never the row count), so a token's numbers
        do not depend on how long its prefill piece is."""
        if prefill and self.dense is not None:
            if x.shape[0] == 1:  # oneDNN multiplies one row another way (a GEMV): keep every row on its GEMM
                return F.linear(x.to(self.dense.dtype).expand(2, -1), self.dense, self.bias)[:1]
            return F.linear(x.to(self.dense.dtype), self.dense, self.bias)
        if self.qkind >= 0:
            y = self.ext.qmatmul(x, self.w, self.qkind, self.n)  # type: ignore[union-attr]
            return (y if self.bias is None else y + self.bias).to(x.dtype)
        if self.scale is None:
            return F.linear(x, self.w, self.bias)
        if self.group:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, self.group, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)
        return y if self.bias is None else y + self.bias

    def add_to(self, x: torch.Tensor, h: torch.Tensor, prefill: bool = False) -> torch.Tensor:
        """x + self(h) in float32; one addmm when the weight is float32 too (one op fewer per decode step)."""
        if self.w.dtype == torch.float32 and self.bias is None:
            return torch.addmm(x, h, self.w.t())
        return torch.add(x, self(h, prefill))  # type promotion adds in float32: no separate cast

    def numel(self) -> int:
        # qmatmul: [tiles, blocks, bytes]; torch int4: two codes per packed byte.
        n = self.n * self.w.shape[1] * INT4_GROUP if self.qkind >= 0 else self.w.numel() * (2 if self.group else 1)
        return n + (0 if self.bias is None else self.bias.numel())

    def dense_bytes(self) -> int:
        return 0 if self.dense is None else self.dense.numel() * self.dense.element_size()


@dataclass(frozen=True)
class Layer:
    """The RMSNorm weights in front of qkv and gate_up are folded into their columns, except under int4."""

    qkv: Linear
    o: Linear
    qk_norm: torch.Tensor | None  # [n_heads + n_kv_heads, head_dim]: q_norm rows, then k_norm rows
    gate_up: Linear
    down: Linear
    attn_norm: torch.Tensor | None = None  # set when not folded
    ffn_norm: torch.Tensor | None = None
