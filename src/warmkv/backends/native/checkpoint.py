"""What a loader hands the engine: hyperparameters, HF-named weights, tokenizer, template."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .args import ModelArgs
from .qweights import Blocks
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
    # A GGUF's Q4_0/Q4_1/Q8_0 matrices as stored (HF names): quantized engines reuse these codes exactly.
    blocks: dict[str, Blocks] = field(default_factory=dict)
