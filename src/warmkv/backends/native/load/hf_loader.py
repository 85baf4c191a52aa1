"""HF model directories: config.json, *.safetensors, tokenizer.json, tokenizer_config.json."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from ....errors import InvalidModelFile, Unsupported
from ..model.args import ARCHITECTURES, ModelArgs
from .checkpoint import Checkpoint, Lazy
from .tokenizer import from_tokenizer_json

# safetensors' dtype names as torch prints them: layer_weight_types keeps torch's spelling.
_TORCH_DTYPES = {"F32": "torch.float32", "F16": "torch.float16", "BF16": "torch.bfloat16"}


def _read_json(path: Path) -> dict:
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError) as e:
        raise InvalidModelFile(f"cannot read {path}: {e}") from None
    if not isinstance(data, dict):
        raise InvalidModelFile(f"{path} is not a JSON object")
    return data


def _args(cfg: dict) -> ModelArgs:
    arch = cfg.get("model_type", "")
    if arch not in ARCHITECTURES:
        raise Unsupported("architecture", f"model_type {arch!r}; the native engine runs {', '.join(ARCHITECTURES)}")
    try:
        n_heads = int(cfg["num_attention_heads"])
        dim = int(cfg["hidden_size"])
        scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind not in ("default", "llama3"):
            raise Unsupported("rope scaling", f"{kind!r}; supported: default, llama3")
        theta = cfg.get("rope_theta") or scaling.get("rope_theta") or 10000.0
        llama3 = None
        if kind == "llama3":
            llama3 = (
                float(scaling["factor"]),
                float(scaling["low_freq_factor"]),
                float(scaling["high_freq_factor"]),
                int(scaling["original_max_position_embeddings"]),
            )
        return ModelArgs(
            arch=arch,
            vocab_size=int(cfg["vocab_size"]),
            dim=dim,
            n_layers=int(cfg["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
            head_dim=int(cfg.get("head_dim") or dim // n_heads),
            hidden_dim=int(cfg["intermediate_size"]),
            norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            max_seq_len=int(cfg.get("max_position_embeddings", 2048)),
            tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "qwen2" or bool(cfg.get("attention_bias", False)),
            qk_norm=arch == "qwen3",
            rope_llama3=llama3,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise InvalidModelFile(f"config.json is missing or has a bad field: {e}") from None


def load_hf(path: Path) -> Checkpoint:
    cfg = _read_json(path / "config.json")
    args = _args(cfg)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InvalidModelFile(f"{path} has no *.safetensors weights")
    where: dict[str, Path] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, str] = {}
    for f in files:
        try:
            with safe_open(str(f), "pt") as st:
                for k in st.keys():  # noqa: SIM118 - safe_open is not a mapping
                    part = st.get_slice(k)
                    where[k], shapes[k], dtypes[k] = f, tuple(part.get_shape()), part.get_dtype()
        except (SafetensorError, OSError) as e:
            raise InvalidModelFile(f"cannot read {f}: {e}") from None

    def tensor(name: str) -> torch.Tensor:
        with safe_open(str(where[name]), "pt") as st:
            return st.get_tensor(name).float()

    tok_cfg = _read_json(path / "tokenizer_config.json") if (path / "tokenizer_config.json").exists() else {}
    if not (path / "tokenizer.json").exists():
        raise InvalidModelFile(f"{path} has no tokenizer.json")
    bos, eos = cfg.get("bos_token_id"), cfg.get("eos_token_id")
    eos = eos[0] if isinstance(eos, list) else eos
    tokenizer = from_tokenizer_json(str(path / "tokenizer.json"), bos, eos, args.vocab_size)
    template = tok_cfg.get("chat_template")
    if template is None and (path / "chat_template.jinja").exists():
        template = (path / "chat_template.jinja").read_text(encoding="utf-8")
    return Checkpoint(
        args=args,
        weights=Lazy(shapes, tensor),
        tokenizer=tokenizer,
        chat_template=template if isinstance(template, str) else None,
        name=str(cfg.get("_name_or_path") or path.name),
        add_bos=bool(tok_cfg.get("add_bos_token", False)),
        metadata={"general.architecture": args.arch, "source": "hf"},
        layer_weight_types=frozenset(
            _TORCH_DTYPES.get(t, t) for n, t in dtypes.items() if ".layers." in n and len(shapes[n]) == 2
        ),
    )
