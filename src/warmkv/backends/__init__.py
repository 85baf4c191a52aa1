"""Backend registry: backends are found by name and imported only when used."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ..config import RuntimeConfig
from ..errors import BackendUnavailable, InvalidConfig
from .base import Backend, ForwardRow, KVMemory, ModelInfo, ModelState
from .options import BackendOptions, LlamaCppOptions, NativeOptions


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str  # imported lazily: a backend's heavy deps load only when it is used
    requires: tuple[str, ...]
    install_hint: str
    options: type[BackendOptions] = BackendOptions  # what the backend's load() takes


_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> None:
    _REGISTRY[spec.name] = spec


register(
    BackendSpec(
        name="llamacpp",
        module="warmkv.backends.llamacpp.backend",
        requires=("llama_cpp",),
        install_hint="pip install 'llama-cpp-python==0.3.36'",
        options=LlamaCppOptions,
    )
)
register(
    BackendSpec(
        name="native",
        module="warmkv.backends.native",
        requires=("torch", "tokenizers", "gguf"),
        install_hint="pip install 'warmkv[native]' (torch==2.13.0, tokenizers, gguf, safetensors)",
        options=NativeOptions,
    )
)


def _missing(spec: BackendSpec) -> list[str]:
    return [m for m in spec.requires if importlib.util.find_spec(m) is None]


def available_backends() -> list[str]:
    """Names of registered backends whose dependencies are importable here."""
    out = []
    for name, spec in _REGISTRY.items():
        if _missing(spec):
            continue
        if importlib.util.find_spec(spec.module) is None:
            continue
        out.append(name)
    return out


def registered_backends() -> list[str]:
    return list(_REGISTRY)


def options_type(name: str) -> type[BackendOptions]:
    """The options record backend `name` takes (BackendUnavailable for an unknown name)."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise BackendUnavailable(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    return spec.options


def make_options(name: str, given: BackendOptions | Mapping[str, Any] | None = None, **more: Any) -> BackendOptions:
    """Backend `name`'s typed options from a record or a mapping, plus keyword options (which win)."""
    cls = options_type(name)
    if isinstance(given, BackendOptions):
        if type(given) is not cls:
            raise InvalidConfig(f"backend {name!r} takes {cls.__name__}, got {type(given).__name__}")
        return cls.from_kwargs(name, {**given.as_dict(), **more}) if more else given
    if given is not None and not isinstance(given, Mapping):
        raise InvalidConfig(f"backend options must be a mapping or {cls.__name__}, got {type(given).__name__}")
    return cls.from_kwargs(name, {**dict(given or {}), **more})


def load_backend(
    name: str,
    model_path: str,
    config: RuntimeConfig,
    options: BackendOptions | Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> Backend:
    """Import the backend by name and load the model into it, with its options (a record, or by name)."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise BackendUnavailable(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    opts = make_options(name, options, **kwargs)
    missing = _missing(spec)
    if missing:
        raise BackendUnavailable(
            f"backend {name!r} needs {', '.join(missing)}, which is not installed: {spec.install_hint}"
        )
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} failed to import: {e}; {spec.install_hint}") from e
    loader: Callable[..., Backend] = module.load
    return loader(model_path, config, opts)


__all__ = [
    "Backend",
    "BackendOptions",
    "BackendSpec",
    "ForwardRow",
    "KVMemory",
    "LlamaCppOptions",
    "ModelInfo",
    "ModelState",
    "NativeOptions",
    "available_backends",
    "load_backend",
    "make_options",
    "options_type",
    "register",
    "registered_backends",
]
