"""What a build derives from a checkpoint: every matrix and norm in the engine's form (packed 4-bit
tiles, int8 rows, folded norms, coded embedding rows), as one value that a load cache writes out as
named tensors and reads back without reading or converting the checkpoint again.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import gguf
import numpy as np
import torch

from ....errors import InvalidModelFile
from ..load.coded_rows import CodedRows
from ..load.weight_arena import WeightArena
from .linear import Layer, Linear

_LINEAR_TENSORS = ("w", "bias", "scale", "dense")
_LAYER_LINEARS = ("qkv", "o", "gate_up", "down")
_LAYER_NORMS = ("qk_norm", "attn_norm", "ffn_norm")


@dataclass(frozen=True)
class Parts:
    lm_head: Linear
    embed: torch.Tensor | CodedRows
    norm: torch.Tensor
    layers: tuple[Layer, ...]
    post_norms: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()  # Gemma 3: (after attention, after the MLP)

    def linears(self) -> list[Linear]:
        """Every matrix in the order a build places them: the head's, then each layer's in step order."""
        return [self.lm_head] + [getattr(layer, n) for layer in self.layers for n in _LAYER_LINEARS]

    def placed(self, arena: WeightArena | None) -> Parts:
        """These parts with their packed matrices copied into `arena`, in build order (a decode step
        then streams them as it streams a fresh build's: see weight_arena.py)."""
        if arena is None:
            return self

        def place(x: Linear) -> Linear:
            return replace(x, w=arena.place(x.w), ext=arena.ext) if x.qkind >= 0 else x

        layers = tuple(replace(layer, **{n: place(getattr(layer, n)) for n in _LAYER_LINEARS}) for layer in self.layers)
        return replace(self, lm_head=place(self.lm_head), layers=layers)

    def nbytes(self) -> int:
        """Bytes of every tensor the parts hold (a tied head's table once)."""
        return sum(t.numel() * t.element_size() for t in self.tensors(copy=False)[0].values())

    def tensors(self, copy: bool = True) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
        """Named tensors (each its own contiguous copy where it is a view, unless not `copy`) and the
        spec that says what they make, for `from_tensors`."""
        out: dict[str, torch.Tensor] = {}
        aliases: dict[str, str] = {}
        spec: dict[str, object] = {"layers": len(self.layers), "post_norms": len(self.post_norms), "aliases": aliases}
        seen: dict[tuple[int, int, tuple[int, ...]], str] = {}

        def put(name: str, t: torch.Tensor | None) -> None:
            if t is None:
                return
            key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
            if key in seen:  # one tensor under two names (a tied head's float table): written once
                aliases[name] = seen[key]
                return
            seen[key] = name
            whole = t.untyped_storage().nbytes() == t.numel() * t.element_size() and t.storage_offset() == 0
            out[name] = t if not copy or (whole and t.is_contiguous()) else t.contiguous().clone()  # a view: a copy

        def linear(name: str, x: Linear) -> None:
            for f in _LINEAR_TENSORS:
                put(f"{name}.{f}", getattr(x, f))
            spec[name] = {"group": x.group, "qkind": x.qkind, "n": x.n}

        linear("lm_head", self.lm_head)
        if isinstance(self.embed, CodedRows):
            put("embed", torch.from_numpy(self.embed.codes))
            e = self.embed
            spec["embed"] = {"qtype": int(e.qtype), "cols": e.cols, "dtype": str(e.codes.dtype)}
        else:
            put("embed", self.embed)
        put("norm", self.norm)
        for i, layer in enumerate(self.layers):
            for n in _LAYER_LINEARS:
                linear(f"layers.{i}.{n}", getattr(layer, n))
            for n in _LAYER_NORMS:
                put(f"layers.{i}.{n}", getattr(layer, n))
        for i, (attn, ffn) in enumerate(self.post_norms):
            put(f"post_norms.{i}.attn", attn)
            put(f"post_norms.{i}.ffn", ffn)
        return out, spec

    @staticmethod
    def from_tensors(t: dict[str, torch.Tensor], spec: dict[str, object]) -> Parts:
        """The parts `tensors` described; InvalidModelFile when one is missing (a damaged cache file)."""
        try:
            return _parts(t, spec)
        except (KeyError, TypeError, ValueError) as e:
            raise InvalidModelFile(f"a load cache file lacks or garbles {e}") from None


def _parts(t: dict[str, torch.Tensor], spec: dict[str, object]) -> Parts:
    t = t | {name: t[first] for name, first in _dict(spec, "aliases").items()}

    def linear(name: str) -> Linear:
        s = _dict(spec, name)
        fields = {f: t.get(f"{name}.{f}") for f in _LINEAR_TENSORS}
        return Linear(**fields, group=int(s["group"]), qkind=int(s["qkind"]), n=int(s["n"]))  # type: ignore[arg-type]

    coded = spec.get("embed")
    embed: torch.Tensor | CodedRows = t["embed"]
    if isinstance(coded, dict):
        codes = t["embed"].numpy().view(np.dtype(str(coded["dtype"])))
        embed = CodedRows(codes, gguf.GGMLQuantizationType(int(coded["qtype"])), int(coded["cols"]))
    n_layers, n_post = int(spec["layers"]), int(spec["post_norms"])  # type: ignore[call-overload]
    layers = tuple(
        Layer(
            **{n: linear(f"layers.{i}.{n}") for n in _LAYER_LINEARS},  # type: ignore[arg-type]
            **{n: t.get(f"layers.{i}.{n}") for n in _LAYER_NORMS},
        )
        for i in range(n_layers)
    )
    post = tuple((t[f"post_norms.{i}.attn"], t[f"post_norms.{i}.ffn"]) for i in range(n_post))
    return Parts(linear("lm_head"), embed, t["norm"], layers, post)


def _dict(spec: dict[str, object], key: str) -> dict[str, object]:
    v = spec[key]
    if not isinstance(v, dict):
        raise TypeError(f"{key} in the spec ({type(v).__name__}, not an object)")
    return v
