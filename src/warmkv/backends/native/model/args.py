"""Model hyperparameters, one frozen record for every supported architecture."""

from __future__ import annotations

from dataclasses import dataclass

from ....errors import InvalidModelFile

# HF model_type / GGUF general.architecture names this engine runs.
ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


@dataclass(frozen=True)
class ModelArgs:
    arch: str
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    hidden_dim: int
    norm_eps: float
    rope_theta: float
    max_seq_len: int
    tie_embeddings: bool
    qkv_bias: bool = False
    qk_norm: bool = False
    # llama3 rope scaling: (factor, low_freq_factor, high_freq_factor, original_max_position_embeddings)
    rope_llama3: tuple[float, float, float, int] | None = None
    # Gemma 3: layers where swa_layers[i] is True attend to the last sliding_window tokens and
    # rotate with rope_local_theta; the others attend to every token with rope_theta.
    sliding_window: int = 0
    swa_layers: tuple[bool, ...] = ()
    rope_local_theta: float = 10000.0
    attn_scale: float | None = None  # None: head_dim ** -0.5
    logit_softcap: float = 0.0  # 0: none; else logits = c * tanh(logits / c)

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "hidden_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise InvalidModelFile(f"model {name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise InvalidModelFile(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise InvalidModelFile(f"head_dim={self.head_dim} must be even for RoPE")
        if self.swa_layers and (len(self.swa_layers) != self.n_layers or self.sliding_window < 1):
            raise InvalidModelFile(
                f"sliding window {self.sliding_window} over {len(self.swa_layers)} layer flags "
                f"for {self.n_layers} layers: need a window >= 1 and one flag per layer"
            )
