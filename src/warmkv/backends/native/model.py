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

from ...errors import InvalidModelFile
from .args import ModelArgs
from .attention import RowPlan, paged_attention
from .paged_kv import PagedKVCache
from .rope import Rope, apply


@dataclass(frozen=True)
class Linear:
    """y = x W^T + b; W is float, or int8 with a scale per output row (weight-only quantization)."""

    w: torch.Tensor
    bias: torch.Tensor | None = None
    scale: torch.Tensor | None = None

    @staticmethod
    def make(w: torch.Tensor, dtype: torch.dtype, int8: bool, bias: torch.Tensor | None = None) -> Linear:
        b = None if bias is None else bias.to(dtype)
        if not int8:
            return Linear(w.to(dtype).contiguous(), b)
        # Decode is memory-bound: int8 rows read 4x fewer bytes than float32.
        scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127.0
        q = torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8).contiguous()
        return Linear(q, b, scale.to(dtype))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.scale is None:
            return F.linear(x, self.w, self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x, self.w, self.scale)
        return y if self.bias is None else y + self.bias

    def add_to(self, x: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
        """x + self(h) in float32; one addmm when the weight is float32 too (one op fewer per decode step)."""
        if self.w.dtype == torch.float32 and self.bias is None:
            return torch.addmm(x, h, self.w.t())
        return x + self(h).float()

    def numel(self) -> int:
        return self.w.numel() + (0 if self.bias is None else self.bias.numel())


@dataclass(frozen=True)
class Layer:
    """The RMSNorm weights in front of qkv and gate_up are folded into their columns."""

    qkv: Linear
    o: Linear
    qk_norm: torch.Tensor | None  # [n_heads + n_kv_heads, head_dim]: q_norm rows, then k_norm rows
    gate_up: Linear
    down: Linear


def _take(weights: dict[str, torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    w = weights.get(name)
    if w is None:
        raise InvalidModelFile(f"weight {name} is missing")
    if tuple(w.shape) != shape:
        raise InvalidModelFile(f"weight {name} has shape {tuple(w.shape)}, expected {shape}")
    return w


class Transformer:
    def __init__(
        self, args: ModelArgs, weights: dict[str, torch.Tensor], dtype: torch.dtype, max_pos: int, int8: bool = False
    ) -> None:
        a = args
        self.args, self.dtype = a, dtype
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        self.embed = _take(weights, "model.embed_tokens.weight", (a.vocab_size, a.dim)).float()
        head = self.embed if a.tie_embeddings else _take(weights, "lm_head.weight", (a.vocab_size, a.dim))
        self.lm_head = Linear.make(head, dtype, int8)
        self.norm = _take(weights, "model.norm.weight", (a.dim,)).float()
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
            qk_norm = None
            if a.qk_norm:
                qn, kn = w("self_attn.q_norm.weight", (a.head_dim,)), w("self_attn.k_norm.weight", (a.head_dim,))
                qk_norm = torch.cat((qn.float().expand(a.n_heads, -1), kn.float().expand(a.n_kv_heads, -1)))
            self.layers.append(
                Layer(
                    qkv=Linear.make(torch.cat(qkv).float() * attn_norm, dtype, int8, bias),
                    o=Linear.make(w("self_attn.o_proj.weight", (a.dim, q_dim)), dtype, int8),
                    qk_norm=qk_norm,
                    gate_up=Linear.make(gate_up.float() * ffn_norm, dtype, int8),
                    down=Linear.make(w("mlp.down_proj.weight", (a.dim, a.hidden_dim)), dtype, int8),
                )
            )
        self.rope = Rope(a, max_pos)
        self.scale = a.head_dim**-0.5
        self._qk_dim = q_dim + kv_dim

    def n_params(self) -> int:
        a = self.args
        n = self.embed.numel() + self.norm.numel() + (0 if a.tie_embeddings else self.lm_head.numel())
        for layer in self.layers:
            n += layer.qkv.numel() + layer.o.numel() + layer.gate_up.numel() + layer.down.numel()
            n += 2 * a.dim + (2 * a.head_dim if a.qk_norm else 0)  # the folded and per-head norm weights
        return n

    def _scale(self, x: torch.Tensor) -> torch.Tensor:
        """RMSNorm without its weight, in few ops: each small op costs microseconds after a large matmul."""
        return x * (torch.mean(x * x, dim=-1, keepdim=True) + self.args.norm_eps).rsqrt_()

    @torch.inference_mode()
    def forward(
        self,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowPlan],
        write_slots: torch.Tensor,
        logit_index: torch.Tensor,
        cache: PagedKVCache,
    ) -> torch.Tensor:
        """tokens, positions, write_slots: [T]; returns float32 logits [len(logit_index), vocab]."""
        a, dt = self.args, self.dtype
        t, n_qk = tokens.shape[0], a.n_heads + a.n_kv_heads
        x = self.embed[tokens]
        cos, sin = self.rope.tables(positions, dt)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(self._scale(x).to(dt))
            qk = qkv[:, : self._qk_dim].reshape(t, n_qk, a.head_dim)
            v = qkv[:, self._qk_dim :].reshape(t, a.n_kv_heads, a.head_dim)
            if layer.qk_norm is not None:
                qk = (self._scale(qk.float()) * layer.qk_norm).to(dt)
            qk = apply(qk, cos, sin)  # q and k rotated together
            q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]
            cache.write(li, write_slots, k, v)
            o = paged_attention(q, cache, li, rows, self.scale)
            x = layer.o.add_to(x, o.reshape(t, -1))
            gate, up = layer.gate_up(self._scale(x).to(dt)).chunk(2, dim=-1)
            x = layer.down.add_to(x, F.silu(gate) * up)
        h = F.rms_norm(x[logit_index], (a.dim,), self.norm, a.norm_eps).to(dt)
        return self.lm_head(h).float()
