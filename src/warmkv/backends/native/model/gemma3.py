"""Gemma 3 on the Llama-family layers: what it adds, computed as llama.cpp's gemma3 graph does.

    x = embed[token] * sqrt(dim)
    per layer:  h = x + post_attn_norm(attention(attn_norm(x)))      q, k: per-head RMSNorm, then RoPE
                x = h + post_ffn_norm(down(gelu_tanh(gate(n)) * up(n))), n = ffn_norm(h)
    logits = final_norm(x) @ embed^T (tied), soft-capped when the file says so

Five of every six layers slide: they see the last `sliding_window` tokens and rotate with
base 10000; the rest see everything and rotate with the file's rope.freq_base. The paged
pool keeps every token of every layer: the global layers need them all, so no block can
be dropped when it leaves the window (that would pay only for an all-local model).

Norm weights are used as stored: llama.cpp's converter already added Gemma's +1 (its graph
multiplies by the stored weight), so the GGUF holds 1 + w.
"""

from __future__ import annotations

import math
from dataclasses import replace

import torch
import torch.nn.functional as F

from ..kv.paged_kv import PagedKVCache
from ..load.checkpoint import Lazy
from ..load.coded_rows import CodedRows
from ..load.qweights import Blocks
from .attention import RowPlan, paged_attention
from .linear import Linear
from .parts import Parts
from .rope import Rope, apply
from .transformer import Transformer, _take

# Why the C++ decode loop does not take these layers: it runs the Llama layer (SiLU, two norms,
# one key range for every layer); Gemma 3 decodes in the Python loop.
CPP_LOOP_UNSUPPORTED = "the C++ decode loop has no post-norms, GELU or sliding-window layers; gemma3 decodes in Python"


# ATen's float32 GEMM on this engine's CPUs takes one kernel for 2-15 rows and another from 16 on
# (measured: the rows of a 2-15 row product are bitwise alike, a 16-row one differs by ~4e-5).
_SMALL_GEMM = 15


def _mm(lin: Linear, x: torch.Tensor, prefill: bool) -> torch.Tensor:
    """lin(x) with every decode row through the same kernel whatever its batch: one row alone would
    take a GEMV and 16 or more another GEMM, each rounding its own way (2e-5 on the logits)."""
    if prefill or lin.scale is not None or lin.qkind >= 0:
        return lin(x, prefill)
    if x.shape[0] == 1:
        return lin(x.expand(2, -1), prefill)[:1]
    if x.shape[0] <= _SMALL_GEMM:
        return lin(x, prefill)
    parts = [x[i : i + _SMALL_GEMM] for i in range(0, x.shape[0], _SMALL_GEMM)]
    return torch.cat([_mm(lin, part, prefill) for part in parts])


class Gemma3(Transformer):
    FFN_NORM = "pre_feedforward_layernorm"

    def _build_parts(
        self, weights: Lazy[torch.Tensor], blocks: Lazy[Blocks], rows: Lazy[CodedRows] | None, quant: str
    ) -> Parts:
        a = self.args
        post = []
        for i in range(a.n_layers):
            p = f"model.layers.{i}."
            attn = _take(weights, f"{p}post_attention_layernorm.weight", (a.dim,)).float().to(self.device)
            ffn = _take(weights, f"{p}post_feedforward_layernorm.weight", (a.dim,)).float().to(self.device)
            post.append((attn, ffn))
        return replace(super()._build_parts(weights, blocks, rows, quant), post_norms=tuple(post))

    def _assemble(self, parts: Parts, max_pos: int) -> None:
        super()._assemble(parts, max_pos)
        a = self.args
        self.post_norms = list(parts.post_norms)
        self.local_rope = Rope(replace(a, rope_theta=a.rope_local_theta, rope_llama3=None), max_pos, self.device)
        self.scale = a.head_dim**-0.5 if a.attn_scale is None else a.attn_scale
        self.embed_scale = math.sqrt(a.dim)  # a float32 multiply after the lookup, as llama.cpp scales

    def n_params(self) -> int:
        return super().n_params() + 2 * self.args.dim * self.args.n_layers

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens] * self.embed_scale

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowPlan],
        write_slots: torch.Tensor,
        cache: PagedKVCache,
        prefill: bool,
    ) -> torch.Tensor:
        a, dt = self.args, self.dtype
        if not prefill and self._ext is not None:
            dt = torch.float32  # qmatmul takes and gives float32
        t, n_qk = x.shape[0], a.n_heads + a.n_kv_heads
        tables = {False: self.rope.tables(positions, dt), True: self.local_rope.tables(positions, dt)}
        plans = {False: rows, True: [r.windowed(a.sliding_window) for r in rows]}
        for li, layer in enumerate(self.layers):
            swa = a.swa_layers[li]
            cos, sin = tables[swa]
            qkv = _mm(layer.qkv, self._norm(x, layer.attn_norm).to(dt), prefill)
            qk = qkv[:, : self._qk_dim].reshape(t, n_qk, a.head_dim)
            v = qkv[:, self._qk_dim :].reshape(t, a.n_kv_heads, a.head_dim)
            qk = apply((self._scale(qk.float()) * layer.qk_norm).to(dt), cos, sin)
            q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]
            cache.write(li, write_slots, k, v)
            o = paged_attention(q, cache, li, plans[swa], self.scale)
            post_attn, post_ffn = self.post_norms[li]
            x = x + self._scale(_mm(layer.o, o.reshape(t, -1), prefill).float()) * post_attn
            gate, up = _mm(layer.gate_up, self._norm(x, layer.ffn_norm).to(dt), prefill).chunk(2, dim=-1)
            x = x + self._scale(_mm(layer.down, F.gelu(gate, approximate="tanh") * up, prefill).float()) * post_ffn
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        h = F.rms_norm(x, (a.dim,), self.norm, a.norm_eps)
        logits = _mm(self.lm_head, h if self.lm_head.qkind >= 0 else h.to(self.dtype), False).float()
        c = a.logit_softcap
        return logits if not c else torch.tanh(logits / c) * c
