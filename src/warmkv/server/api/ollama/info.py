"""The served model as Ollama describes a model: /api/tags, /api/ps and /api/show bodies.

Family, parameter size and quantization come from the GGUF's metadata; the context length
a client can use is the served one (`num_ctx`), the model's trained one stays in model_info.
"""

from __future__ import annotations

import math
import os
from datetime import UTC, datetime, timedelta
from typing import Any

import llama_cpp

from ....errors import Unsupported
from ...state import ServerState

# GGUF general.file_type -> the name Ollama shows (Q4_1, Q4_K_M, F16...), from llama.cpp's own table.
_FILE_TYPES = {
    v: k.removeprefix("LLAMA_FTYPE_").removeprefix("MOSTLY_").removeprefix("ALL_")
    for k, v in vars(llama_cpp).items()
    if k.startswith("LLAMA_FTYPE_") and isinstance(v, int)
}
# Ollama reports a model kept loaded for good as expiring this far ahead (Go's longest duration).
_FOREVER = timedelta(microseconds=(2**63 - 1) // 1000)


def _iso(t: datetime) -> str:
    return t.isoformat().replace("+00:00", "Z")


def tagged(name: str) -> str:
    """A model name as Ollama lists it: with a tag (":latest" when it has none)."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


def human_number(n: int) -> str:
    """A parameter count as Ollama writes it (its format.HumanNumber): 134.52M, 7B, 1.5B."""
    for size, unit, places in ((1e9, "B", 1), (1e6, "M", 2), (1e3, "K", 0)):
        if n >= size:
            x = n / size
            return f"{x:.0f}{unit}" if x == int(x) else f"{x:.{places}f}{unit}"
    return str(n)


def quantization(st: ServerState) -> str:
    raw = st.runtime.info.metadata.get("general.file_type", "")
    return _FILE_TYPES.get(int(raw), f"file_type {raw}") if raw.isdigit() else ""


def details(st: ServerState) -> dict[str, Any]:
    info = st.runtime.info
    return {
        "parent_model": "",
        "format": "gguf",
        "family": info.architecture,
        "families": [info.architecture],
        "parameter_size": human_number(info.n_params),
        "quantization_level": quantization(st),
    }


def _modified(st: ServerState) -> str:
    return _iso(datetime.fromtimestamp(os.path.getmtime(st.runtime.info.path), UTC))


def _names(st: ServerState) -> list[str]:
    """The served model, then each name configured for it with --model-alias (as /v1/models)."""
    return [tagged(n) for n in dict.fromkeys((st.model_id, *(a for a in st.settings.model_aliases if a != "*")))]


def tags(st: ServerState) -> dict[str, Any]:
    info = st.runtime.info
    common = {"modified_at": _modified(st), "size": info.size_bytes, "digest": info.file_digest, "details": details(st)}
    return {"models": [{"name": n, "model": n, **common} for n in _names(st)]}


def unloaded_tag(model_id: str, path: str) -> dict[str, Any]:
    """/api/tags for a model not loaded: what its file says without reading it."""
    try:
        size, mtime = os.path.getsize(path), os.path.getmtime(path)
    except OSError:
        size, mtime = 0, 0.0
    name = tagged(model_id)
    return {"name": name, "model": name, "modified_at": _iso(datetime.fromtimestamp(mtime, UTC)), "size": size,
            "digest": "", "details": {"format": "gguf" if path.endswith(".gguf") else "safetensors"}}  # fmt: skip


def ps(st: ServerState, expires_in_s: float = math.inf) -> dict[str, Any]:
    """A loaded model: its weights and KV memory in `size`; expires_at is when its idle time ends."""
    info = st.runtime.info
    name = tagged(st.model_id)
    left = _FOREVER if math.isinf(expires_in_s) else timedelta(seconds=expires_in_s)
    model = {
        "name": name,
        "model": name,
        "size": info.size_bytes + st.runtime.stats.kv_memory.bytes,
        "digest": info.file_digest,
        "details": details(st),
        "expires_at": _iso(datetime.now(UTC) + left),
        "size_vram": 0,
        "context_length": st.runtime.config.num_ctx,
    }
    return {"models": [model]}


def _value(text: str) -> Any:
    """A GGUF metadata value (read back as text) as its JSON type."""
    if text in ("true", "false"):
        return text == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def capabilities(st: ServerState) -> list[str]:
    """completion; tools (calls are constrained for every template); insert with FIM tokens;
    thinking when the template's think blocks are parsed."""
    out = ["completion", "tools"]
    try:
        st.runtime.fim_tokens()
        out.append("insert")
    except Unsupported:
        pass
    if st.thinks:
        out.append("thinking")
    return out


def show(st: ServerState) -> dict[str, Any]:
    rt = st.runtime
    info = rt.info
    meta = {k: _value(v) for k, v in sorted(info.metadata.items()) if k != "tokenizer.chat_template"}
    meta["general.parameter_count"] = info.n_params
    num_ctx = rt.config.num_ctx
    return {
        "license": info.metadata.get("general.license", ""),
        "modelfile": f"# Modelfile generated by warmkv\nFROM {info.path}\nPARAMETER num_ctx {num_ctx}\n",
        "parameters": f"{'num_ctx':<30} {num_ctx}",
        "template": rt.template_choice.source or "",
        "details": details(st),
        "model_info": meta,
        "capabilities": capabilities(st),
        "modified_at": _modified(st),
    }
