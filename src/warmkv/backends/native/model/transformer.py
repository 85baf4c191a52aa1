"""Llama-family forward pass over a flat multi-sequence batch (no padding).

Covers Llama 2/3, SmolLM, Mistral (full attention), Qwen2 (QKV bias) and Qwen3
(per-head q/k RMSNorm). Weights are plain tensors with Q/K/V and gate/up fused,
so a layer is a handful of large matmuls. The residual stream stays float32;
matmuls run in the compute dtype (float32 or bfloat16).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from types import ModuleType

import torch
import torch.nn.functional as F

from ....errors import InvalidModelFile, Unsupported
from ..cpp.decode_ext import DecodeLoop
from ..kv.paged_kv import PagedKVCache
from ..load.checkpoint import Lazy
from ..load.coded_rows import CodedRows
from ..load.qweights import Blocks, cat, quantize_q4, quantize_q8
from ..load.weight_arena import WeightArena
from .args import ModelArgs
from .attention import RowPlan, paged_attention
from .linear import INT4_GROUP, Layer, Linear
from .parts import Parts
from .rope import Rope, apply

log = logging.getLogger(__name__)


def _shape(weights: Lazy[torch.Tensor], name: str, shape: tuple[int, ...]) -> str:
    """Check a weight's shape without making it; returns its name."""
    got = weights.shape(name)
    if got is None:
        raise InvalidModelFile(f"weight {name} is missing")
    if got != shape:
        raise InvalidModelFile(f"weight {name} has shape {got}, expected {shape}")
    return name


def _take(weights: Lazy[torch.Tensor], name: str, shape: tuple[int, ...]) -> torch.Tensor:
    return weights[_shape(weights, name, shape)]


class Transformer:
    FFN_NORM = "post_attention_layernorm"  # the HF name of the norm in front of the MLP

    def __init__(
        self,
        args: ModelArgs,
        weights: Lazy[torch.Tensor],
        dtype: torch.dtype,
        max_pos: int,
        quant: str = "none",
        device: torch.device | None = None,
        blocks: Lazy[Blocks] | None = None,
        ext: ModuleType | None = None,
        prefill_dense: bool = True,
        rows: Lazy[CodedRows] | None = None,
    ) -> None:
        """quant: "none", "int8" or "int4" weights (int4 keeps the output head at 8 bits: it is the most sensitive).

        device: where weights and activations live (default CPU); quantized weights are CPU only.
        int4 with `ext` (the C++ kernels): every matmul of a decode row runs qmatmul on 4-bit blocks
        (a GGUF's own codes from `blocks` where given) and the head on 8-bit ones; prefill_dense
        keeps a bfloat16 copy of the layers for prefill rows (2 bytes a weight, ~4x the 4-bit codes).
        rows: a GGUF's coded matrices by row; on the CPU the token embeddings stay in their codes.
        """
        device = torch.device("cpu") if device is None else device
        if quant != "none" and device.type != "cpu":
            raise Unsupported("quantized weights", f"{quant} runs on torch's CPU kernels, not on {device}")
        self.args, self.dtype, self.device = args, dtype, device
        self._ext = ext if quant == "int4" else None
        self._dense = prefill_dense
        parts = self._build_parts(weights, blocks if blocks is not None else Lazy.none(), rows, quant)
        self._assemble(parts, max_pos)

    @classmethod
    def from_parts(
        cls,
        args: ModelArgs,
        parts: Parts,
        dtype: torch.dtype,
        max_pos: int,
        device: torch.device,
        ext: ModuleType | None,
        prefill_dense: bool,
    ) -> Transformer:
        """The model of parts a build made before (a load cache's): nothing read from a checkpoint.
        Packed matrices come back into a new weight arena, in the order the build placed them."""
        model = cls.__new__(cls)
        model.args, model.dtype, model.device = args, dtype, device
        model._ext, model._dense = ext, prefill_dense
        model._assemble(parts.placed(None if ext is None else WeightArena(ext)), max_pos)
        return model

    def _assemble(self, parts: Parts, max_pos: int) -> None:
        """What the forward pass reads, set in one place whether built or restored."""
        a = self.args
        self.parts = parts
        self.lm_head, self.embed, self.norm, self.layers = parts.lm_head, parts.embed, parts.norm, list(parts.layers)
        self.rope = Rope(a, max_pos, self.device)
        self.scale = a.head_dim**-0.5
        self._qk_dim = (a.n_heads + a.n_kv_heads) * a.head_dim
        self.decode_loop: DecodeLoop | None = None  # the C++ layer loop for decode steps, when built

    def _build_parts(
        self, weights: Lazy[torch.Tensor], blocks: Lazy[Blocks], rows: Lazy[CodedRows] | None, quant: str
    ) -> Parts:
        """Every matrix and norm from the checkpoint, in the engine's form. blocks are read while
        building, never kept: they map the file."""
        a, device, dtype = self.args, self.device, self.dtype
        # the packed matrices one after another as built: the head's, then the layers' in step order
        arena = None if self._ext is None else WeightArena(self._ext)
        q_dim, kv_dim = a.n_heads * a.head_dim, a.n_kv_heads * a.head_dim
        emb = _shape(weights, "model.embed_tokens.weight", (a.vocab_size, a.dim))
        head = emb if a.tie_embeddings else "lm_head.weight"
        _shape(weights, head, (a.vocab_size, a.dim))
        table: torch.Tensor | None = None  # the float table, once made

        def floats(name: str) -> torch.Tensor:
            nonlocal table
            if name != emb:
                return weights[name]
            if table is None:
                table = weights[emb].float()
            return table

        if arena is not None:
            head_blocks = blocks.get(head) or quantize_q8(floats(head))
            lm_head = Linear.blocks(head_blocks, arena, None, dense=False)
        else:
            lm_head = Linear.make(floats(head), dtype, "int8" if quant == "int4" else quant, device=device)
        # Lookups take the file's codes row by row (coded_rows.py), unless a dense float32 head of a
        # tied model holds the float table anyway: then they share it.
        shared = table is not None and lm_head.w.data_ptr() == table.data_ptr()
        coded = rows is not None and emb in rows and device.type == "cpu" and not shared
        embed: torch.Tensor | CodedRows = rows[emb] if coded else floats(emb).to(device)  # type: ignore[index]
        table = None  # the layers are built without the float table unless it is kept
        # Folding g into the columns would change each 4-bit group's values: int4 keeps the norms apart.
        fold = quant != "int4"
        norm = _take(weights, "model.norm.weight", (a.dim,)).float().to(device)
        layers: list[Layer] = []
        qkv_dims = (("q", q_dim), ("k", kv_dim), ("v", kv_dim))
        for i in range(a.n_layers):
            if i % 8 == 0:
                log.info("building layer %d of %d", i + 1, a.n_layers)
            p = f"model.layers.{i}."
            qkv = [_shape(weights, f"{p}self_attn.{x}_proj.weight", (d, a.dim)) for x, d in qkv_dims]
            gate_up = [_shape(weights, f"{p}mlp.{x}_proj.weight", (a.hidden_dim, a.dim)) for x in ("gate", "up")]
            o = _shape(weights, f"{p}self_attn.o_proj.weight", (a.dim, q_dim))
            down = _shape(weights, f"{p}mlp.down_proj.weight", (a.dim, a.hidden_dim))
            bias = None
            if a.qkv_bias:
                bias = torch.cat([_take(weights, f"{p}self_attn.{x}_proj.bias", (d,)) for x, d in qkv_dims])
            # (x * r * g) W^T == (x * r) (W * g)^T: the norm's weight g costs nothing per step.
            attn_norm = _take(weights, f"{p}input_layernorm.weight", (a.dim,)).float()
            ffn_norm = _take(weights, f"{p}{self.FFN_NORM}.weight", (a.dim,)).float()
            qk_norm = None
            if a.qk_norm:
                qn = _take(weights, f"{p}self_attn.q_norm.weight", (a.head_dim,))
                kn = _take(weights, f"{p}self_attn.k_norm.weight", (a.head_dim,))
                qk_norm = torch.cat((qn.float().expand(a.n_heads, -1), kn.float().expand(a.n_kv_heads, -1)))
            layers.append(
                Layer(
                    qkv=self._linear(weights, blocks, arena, qkv, attn_norm if fold else None, quant, bias),
                    o=self._linear(weights, blocks, arena, [o], None, quant),
                    qk_norm=None if qk_norm is None else qk_norm.to(device),
                    gate_up=self._linear(weights, blocks, arena, gate_up, ffn_norm if fold else None, quant),
                    down=self._linear(weights, blocks, arena, [down], None, quant),
                    attn_norm=None if fold else attn_norm.to(device),
                    ffn_norm=None if fold else ffn_norm.to(device),
                )
            )
        return Parts(lm_head, embed, norm, tuple(layers))

    def _linear(
        self,
        weights: Lazy[torch.Tensor],
        blocks: Lazy[Blocks],
        arena: WeightArena | None,
        names: list[str],
        norm: torch.Tensor | None,
        quant: str,
        bias: torch.Tensor | None = None,
    ) -> Linear:
        """One fused matmul over the rows of `names`, with a norm's weight folded into its columns.

        With the C++ kernels it takes the file's own blocks when every part has them, and then
        never makes the float matrix at all.
        """

        def dense() -> torch.Tensor:
            w = torch.cat([weights[n] for n in names]).float()
            return w if norm is None else w * norm

        cols = weights.shape(names[0])[1]  # type: ignore[index]
        if arena is None or cols % INT4_GROUP:
            return Linear.make(dense(), self.dtype, quant, bias, self.device)
        fused = None
        if all(n in blocks for n in names):
            parts = [blocks[n] for n in names]
            fused = cat(parts) if all(p.kind != "Q8_0" for p in parts) else None
        b = None if bias is None else bias.to(self.dtype)
        return Linear.blocks(fused or quantize_q4(dense()), arena, b, dense=self._dense)

    def dense_bytes(self) -> int:
        """Memory held by the bfloat16 prefill copies."""
        return sum(x.dense_bytes() for layer in self.layers for x in (layer.qkv, layer.o, layer.gate_up, layer.down))

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
        Decode rows (generated tokens, drafts) and prefill pieces run apart, each on its own
        kernels: a token's numbers follow its kind, never what it is batched with.
        """
        x = self._embed(tokens)
        decode = [r for r in rows if r.decode and not hidden]
        loop = self.decode_loop
        if not hidden and loop is not None and loop.prefills:  # one C++ pass for every row: all attend alone
            cos, sin = self.rope.tables(positions, torch.float32)
            x = loop.run(x, cache, rows, write_slots, cos, sin)
        elif len(decode) == len(rows):
            x = self._decode(x, positions, rows, write_slots, cache)
        elif not decode:
            x = self._layers(x, positions, rows, write_slots, cache, prefill=True)
        else:
            prefill = [r for r in rows if not r.decode]
            for part, run in ((decode, self._decode), (prefill, self._prefill)):
                idx = torch.cat([torch.arange(r.offset, r.offset + r.n, device=x.device) for r in part])
                plans, at = [], 0
                for r in part:
                    plans.append(replace(r, offset=at))
                    at += r.n
                x[idx] = run(x[idx], positions[idx], plans, write_slots[idx], cache)
        if hidden:
            return F.rms_norm(x, (self.args.dim,), self.norm, self.args.norm_eps)
        return self._logits(x[logit_index])

    def _embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.embed[tokens]

    def _decode(
        self, x: torch.Tensor, positions: torch.Tensor, rows: list[RowPlan], slots: torch.Tensor, cache: PagedKVCache
    ) -> torch.Tensor:
        if self.decode_loop is not None and self.decode_loop.takes(rows):
            cos, sin = self.rope.tables(positions, torch.float32)  # the C++ loop rotates in float32
            return self.decode_loop.run(x, cache, rows, slots, cos, sin)
        return self._layers(x, positions, rows, slots, cache, prefill=False)

    def _prefill(
        self, x: torch.Tensor, positions: torch.Tensor, rows: list[RowPlan], slots: torch.Tensor, cache: PagedKVCache
    ) -> torch.Tensor:
        return self._layers(x, positions, rows, slots, cache, prefill=True)

    def _layers(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        rows: list[RowPlan],
        write_slots: torch.Tensor,
        cache: PagedKVCache,
        prefill: bool,
    ) -> torch.Tensor:
        """The layer loop in Python: the residual stream after the last layer."""
        a, dt = self.args, self.dtype
        if not prefill and self._ext is not None:
            dt = torch.float32  # qmatmul takes and gives float32, as in the C++ loop
        t, n_qk = x.shape[0], a.n_heads + a.n_kv_heads
        cos, sin = self.rope.tables(positions, dt)
        for li, layer in enumerate(self.layers):
            qkv = layer.qkv(self._norm(x, layer.attn_norm).to(dt), prefill)
            qk = qkv[:, : self._qk_dim].reshape(t, n_qk, a.head_dim)
            v = qkv[:, self._qk_dim :].reshape(t, a.n_kv_heads, a.head_dim)
            if layer.qk_norm is not None:
                qk = (self._scale(qk.float()) * layer.qk_norm).to(dt)
            qk = apply(qk, cos, sin)  # q and k rotated together
            q, k = qk[:, : a.n_heads], qk[:, a.n_heads :]
            cache.write(li, write_slots, k, v)
            o = paged_attention(q, cache, li, rows, self.scale)
            x = layer.o.add_to(x, o.reshape(t, -1), prefill)
            gate, up = layer.gate_up(self._norm(x, layer.ffn_norm).to(dt), prefill).chunk(2, dim=-1)
            x = layer.down.add_to(x, F.silu(gate) * up, prefill)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        a = self.args
        h = F.rms_norm(x, (a.dim,), self.norm, a.norm_eps)
        return self.lm_head(h if self.lm_head.qkind >= 0 else h.to(self.dtype)).float()
