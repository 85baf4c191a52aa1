"""HF transformers' Llama on the same (dequantized) weights as the native engine: the reference."""

from __future__ import annotations

from typing import Any

from ...errors import Unsupported


def transformers_llama(ckpt: Any) -> Any:
    """A LlamaForCausalLM in eval mode holding a native Checkpoint's weights.

    Raises Unsupported for other architectures, or when the weights do not map onto
    transformers' names exactly (only a tied lm_head may be missing).
    """
    import transformers

    a = ckpt.args
    if a.arch != "llama":
        raise Unsupported("transformers comparison", f"architecture {a.arch}")
    cfg = transformers.LlamaConfig(
        vocab_size=a.vocab_size,
        hidden_size=a.dim,
        intermediate_size=a.hidden_dim,
        num_hidden_layers=a.n_layers,
        num_attention_heads=a.n_heads,
        num_key_value_heads=a.n_kv_heads,
        head_dim=a.head_dim,
        rms_norm_eps=a.norm_eps,
        rope_theta=a.rope_theta,
        max_position_embeddings=a.max_seq_len,
        tie_word_embeddings=a.tie_embeddings,
    )
    model = transformers.LlamaForCausalLM(cfg)
    missing, unexpected = model.load_state_dict(dict(ckpt.weights), strict=False)
    if unexpected or not set(missing) <= {"lm_head.weight"}:
        raise Unsupported("transformers comparison", f"weights do not map: missing {missing}, unexpected {unexpected}")
    model.tie_weights()
    model.eval()
    return model
