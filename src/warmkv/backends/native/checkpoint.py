"""What a loader hands the engine: hyperparameters, HF-named weights, tokenizer, template."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .args import ModelArgs
from .tokenizer import TextTokenizer


@dataclass(frozen=True)
class Checkpoint:
    args: ModelArgs
    weights: dict[str, torch.Tensor]  # HF names (model.layers.0.self_attn.q_proj.weight ...), float32
    tokenizer: TextTokenizer
    chat_template: str | None
    name: str
    add_bos: bool
    metadata: dict[str, str] = field(default_factory=dict)
    # How the layers' matmul weights are stored in the file (GGUF types like "Q4_1", or torch dtypes).
    layer_weight_types: frozenset[str] = frozenset()
