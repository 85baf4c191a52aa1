"""What a loader hands the engine: hyperparameters, HF-named weights, tokenizer, template."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Generic, TypeVar

import torch

from ..model.args import ModelArgs
from .coded_rows import CodedRows
from .qweights import Blocks
from .tokenizer import TextTokenizer

T = TypeVar("T")


def _absent(name: str) -> T:
    raise KeyError(name)


class Lazy(Mapping[str, T], Generic[T]):
    """Values made on each access from the loader's mapped file, never kept.

    The engine takes one matrix at a time into its own form (packed 4-bit blocks, a bfloat16
    copy), so a model is never held twice: a 3B GGUF as float32 alone would be 12 GB.
    """

    def __init__(self, shapes: Mapping[str, tuple[int, ...]], make: Callable[[str], T]) -> None:
        self._shapes = dict(shapes)
        self._make = make

    @staticmethod
    def none() -> Lazy[T]:
        return Lazy({}, _absent)

    def shape(self, name: str) -> tuple[int, ...] | None:
        """The value's shape without making it; None when absent."""
        return self._shapes.get(name)

    def __contains__(self, name: object) -> bool:
        return name in self._shapes  # Mapping's own would make the value

    def __getitem__(self, name: str) -> T:
        if name not in self._shapes:
            raise KeyError(name)
        return self._make(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._shapes)

    def __len__(self) -> int:
        return len(self._shapes)


@dataclass(frozen=True)
class Checkpoint:
    args: ModelArgs
    weights: Lazy[torch.Tensor]  # HF names (model.layers.0.self_attn.q_proj.weight ...), float32 on access
    tokenizer: TextTokenizer
    chat_template: str | None
    name: str
    add_bos: bool
    metadata: dict[str, str] = field(default_factory=dict)
    # How the layers' matmul weights are stored in the file (GGUF types like "Q4_1", or torch dtypes).
    layer_weight_types: frozenset[str] = frozenset()
    # A GGUF's Q4_0/Q4_1/Q8_0 matrices as stored (HF names): quantized engines reuse these codes exactly.
    blocks: Lazy[Blocks] = field(default_factory=lambda: Lazy.none())
    # A GGUF's quantized or half-precision matrices as stored, looked up by row (the token embeddings).
    rows: Lazy[CodedRows] = field(default_factory=lambda: Lazy.none())

    def layer_params(self) -> int:
        """Parameters in the layers' matrices, from the shapes alone."""
        return sum(
            s[0] * s[1]
            for k in self.weights
            if k.startswith("model.layers.") and len(s := self.weights.shape(k) or ()) == 2
        )
