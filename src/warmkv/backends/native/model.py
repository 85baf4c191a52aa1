"""Llama-family forward pass over a flat multi-sequence batch (no padding).

Covers Llama 2/3, SmolLM, Mistral (full attention), Qwen2 (QKV bias) and Qwen3
(per-head q/k RMSNorm). Weights are plain tensors with Q/K/V and gate/up fused,
so a layer is a handful of large matmuls. The residual stream stays float32;
matmuls run in the compute dtype (float32 or bfloat16).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ...errors import InvalidModelFile, Unsupported
from .args import ModelArgs
from .attention import RowPlan, paged_attention
from .decode_ext import DecodeLoop
from .paged_kv import PagedKVCache
from .rope import Rope, apply

INT4_GROUP = 32  # Q4_0/Q4_1's block: a GGUF's own 4-bit codes come back exactly


@dataclass(frozen=True)
class Linear:
    """y = x W^T + b, W float or weight-only quantized.

    int8: a scale per output row. int4: groups of 32 inputs with a scale and a minimum
    each (asymmetric, like Q4_1, whose codes it recovers exactly), packed for torch's
    CPU int4 kernel; `scale` then holds [in/32, out, 2] (scale, zero) as it wants them.
    """

    w: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None
    group: int = 0  # int4 group size, 0 otherwise

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

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return F.linear(x, self.w, self.bias)
        if self.group:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x, self.w, self.group, self.scale)
        else:
            y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)
        return y if self.bias is None else y + self.bias

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + self(h) in float32; one addmm when the weight is float32 too (one op fewer per decode step)."""
        if self.w.dtype == torch.float32 and self.bias is None:
            return torch.addmm(x, h, self.w.t())
        return torch.add(x, self(h))  # type promotion adds in float32: no separate cast

    def numel(self) -> int:
        n = self.w.numel() * (2 if self.group else 1)  # int4: two codes per packed byte
        return n + (0 if self.bias is None else self.bias.numel())


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


def _take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    w = weights.get(name)
    if w is None:
        raise InvalidModelFile(f"weight {name} is missing")
    if tuple(w.shape) != shape:
        raise InvalidModelFile(f"weight {name} has shape {tuple(w.shape)}, expected {shape}")
    return w


class Transformer:
    def __init__(
        self,
        args: ModelArgs,
        weights: dict[str, torch.Tensor],
        dtype: torch.dtype,
        max_pos: int,
        quant: str = "none",
        device: torch.device | None = None,
    ) -> None:
        """quant: "none", "int8" or "int4" weights (int4 keeps the output head int8: it is the most sensitive).

        device: where weights and activations live (default CPU); quantized weights are CPU only.
        """
        a = args
        device = torch.device("cpu") if device is None else device
        if quant != "none" and device.type != "cpu":
            raise Unsupported("quantized weights", f"{quant} runs on torch's CPU kernels, not on {device}")
        self.args, self.dtype, self.device = a, dtype, device
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.embed = _take(weights, "model.embed_tokens.weight", (a.vocab_size, a.dim)).float()
        head = self.embed if a.tie_embeddings else _take(weights, "lm_head.weight", (a.vocab_size, a.dim))
        self.lm_head = Linear.make(head, dtype, "int8" if quant == "int4" else quant, device=device)
        self.embed = self.embed.to(device)
        # Folding g into the columns would change each 4-bit group's values: int4 keeps the norms apart.
        fold = quant != "int4"
        self.norm = _take(weights, "model.norm.weight", (a.dim,)).float().to(device)
        self.layers: list[Layer] = []
        for i in range(a.n_layers):
            p = f"model.layers.{i}."

            def w(name: str, shape: tuple[int, ...], p: str = p) -> torch.Tensor:
                return _take(weights, p + name, shape)

            qkv = [w(f"self_attn.{x}_proj.weight", (d, a.dim)) for x, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
            bias = None
            if a.qkv_bias:
                parts = [w(f"self_attn.{x}_proj.bias", (d,)) for x, d in (("q", q_dim), ("k", kv_dim), ("v", kv_dim))]
                bias = torch.cat(parts)
            gate_up = torch.cat(
                [w("mlp.gate_proj.weight", (a.hidden_dim, a.dim)), w("mlp.up_proj.weight", (a.hidden_dim, a.dim))]
            )
            # (x * r * g) W^T == (x * r) (W * g)^T: the norm's weight g costs nothing per step.
            attn_norm = w("input_layernorm.weight", (a.dim,)).float()
            ffn_norm = w("post_attention_layernorm.weight", (a.dim,)).float()
            qkv_w, gate_up_w = torch.cat(qkv).float(), gate_up.float()
            if fold:
                qkv_w, gate_up_w = qkv_w * attn_norm, gate_up_w * ffn_norm
            qk_norm = None
            if a.qk_norm:
                qn, kn = w("self_attn.q_norm.weight", (a.head_dim,)), w("self_attn.k_norm.weight", (a.head_dim,))
                qk_norm = torch.cat((qn.float().expand(a.n_heads, -1), kn.float().expand(a.n_kv_heads, -1)))
            self.layers.append(
                Layer(
                    qkv=Linear.make(qkv_w, dtype, quant, bias, device),
                    o=Linear.make(w("self_attn.o_proj.weight", (a.dim, q_dim)), dtype, quant, device=device),
                    qk_norm=None if qk_norm is None else qk_norm.to(device),
                    gate_up=Linear.make(gate_up_w, dtype, quant, device=device),
                    down=Linear.make(w("mlp.down_proj.weight", (a.dim, a.hidden_dim)), dtype, quant, device=device),
                    attn_norm=None if fold else attn_norm.to(device),
                    ffn_norm=None if fold else ffn_norm.to(device),
                )
            )
        self.rope = Rope(a, max_pos, device)
        self.scale = a.head_dim**-0.5
        self._qk_dim = q_dim + kv_dim
        self.decode_loop: DecodeLoop | None = None  # the C++ layer loop for decode steps, when built

    def n_params(self) -> int:
        a = self.args
        n = self.embed.numel() + self.norm.numel() + (0 if a.tie_embeddings else self.lm_head.numel())
        for layer in self.layers:
            n += layer.qkv.numel() + layer.o.numel() + layer.gate_up.numel() + layer.down.numel()
            n += 2 * a.dim + (2 * a.head_dim if a.qk_norm else 0)  # the norm weights (folded or not)
        return n

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight, in few ops: each small op costs microseconds after a large matmul."""
        return x * (torch.mean(x * x, dim=-1, keepdim=True) + self.args.norm_eps).rsqrt_()

    def _norm(self, x: torch.Tensor, weight: torch.Tensor | None) -> torch.Tensor:
        return self._scale(x) if weight is None else self._scale(x) * weight

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowPlan],
        write_slots: torch.Tensor,
        logit_index: torch.Tensor,
        cache: PagedKVCache,
        hidden: bool = False,
    ) -> torch.Tensor:
        """tokens, positions, write_slots: [T]; returns float32 logits [len(logit_index), vocab].

        hidden=True returns the final-norm hidden state of every token instead, [T, dim] float32.
        """
        a, dt = self.args, self.dtype
        t, n_qk = tokens.shape[0], a.n_heads + a.n_kv_heads
        x = self.embed[tokens]
        if self.decode_loop is not None and not hidden and DecodeLoop.takes(rows):
            cos, sin = self.rope.tables(positions, torch.float32)  # the C++ loop rotates in float32
            x = self.decode_loop.run(x, cache, rows, write_slots, cos, sin)
            return self._logits(x[logit_index])
        cos, sin = self.rope.tables(positions, dt)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(x, layer.attn_norm).to(dt))
            qk = qkv[:, : self._qk_dim].reshape(t, n_qk, a.head_dim)
            v = qkv[:, self._qk_dim :].reshape(t, a.n_kv_heads, a.head_dim)
            if layer.qk_norm is not None:
                qk = (self._scale(qk.float()) * layer.qk_norm).to(dt)
            qk = apply(qk, cos, sin)  # q and k rotated together
            q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]
            cache.write(li, write_slots, k, v)
            o = paged_attention(q, cache, li, rows, self.scale)
            x = layer.o.add_to(x, o.reshape(t, -1))
            gate, up = layer.gate_up(self._norm(x, layer.ffn_norm).to(dt)).chunk(2, dim=-1)
            x = layer.down.add_to(x, F.silu(gate) * up)
        if hidden:
            return F.rms_norm(x, (a.dim,), self.norm, a.norm_eps)
        return self._logits(x[logit_index])

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        return self.lm_head(F.rms_norm(x, (a.dim,), self.norm, a.norm_eps).to(self.dtype)).float()
