"""backend="auto": the native engine where it runs the model fastest, llama.cpp otherwise."""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from ..errors import InvalidConfig
from .options import NATIVE_KV_STORAGE, LlamaCppOptions, NativeOptions

AUTO = "auto"


@dataclass(frozen=True)
class BackendChoice:
    """The backend a runtime runs on, and why (shown by `warmkv info` and logged at load)."""

    name: str
    reason: str


def choose_backend(
    model_path: str | Path, available: Iterable[str], *, option_names: Iterable[str] = (), kv_cache_type: str = "auto"
) -> BackendChoice:
    """The backend for backend="auto": options that only one backend takes pick it; then native
    where its C++ loop runs the model's architecture on 4-bit weights, llama.cpp otherwise."""
    given = set(option_names)
    native_only = given & (set(NativeOptions.names()) - set(LlamaCppOptions.names()))
    llama_only = given & (set(LlamaCppOptions.names()) - set(NativeOptions.names()))
    if native_only and llama_only:
        raise InvalidConfig(
            f"backend 'auto' was given native option(s) {sorted(native_only)} and llama.cpp option(s) "
            f"{sorted(llama_only)}; name the backend"
        )
    if native_only:
        return BackendChoice("native", f"given the native option(s) {', '.join(sorted(native_only))}")
    if llama_only:
        return BackendChoice("llamacpp", f"given the llama.cpp option(s) {', '.join(sorted(llama_only))}")
    have = set(available)
    if "native" not in have:
        return BackendChoice("llamacpp", "the native engine's packages (torch, tokenizers, gguf) are not installed")
    if "llamacpp" not in have:
        return BackendChoice("native", "llama-cpp-python is not installed")
    if kv_cache_type != "auto" and kv_cache_type not in NATIVE_KV_STORAGE:
        return BackendChoice("llamacpp", f"the native engine does not store {kv_cache_type} KV")
    fit = importlib.import_module("warmkv.backends.native.fit")  # torch loads only when native is wanted
    why = fit.native_unfit(Path(model_path))
    if why is not None:
        return BackendChoice("llamacpp", why)
    return BackendChoice("native", "its C++ loop runs this model's architecture on its 4-bit weights")
