"""Backend registry: backends are found by name and imported only when used."""

from __future__ import annotations

import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass

from ..config import RuntimeConfig
from ..errors import BackendUnavailable, InvalidConfig
from .base import Backend, ForwardRow, ModelInfo, ModelState


@dataclass(frozen=True)
class BackendSpec:
    name: str
    module: str  # imported lazily: a backend's heavy deps load only when it is used
    requires: tuple[str, ...]
    install_hint: str


_REGISTRY: dict[str, BackendSpec] = {}


def register(spec: BackendSpec) -> None:
    _REGISTRY[spec.name] = spec


register(
    BackendSpec(
        name="llamacpp",
        module="warmkv.backends.llamacpp",
        requires=("llama_cpp",),
        install_hint="pip install 'llama-cpp-python==0.3.36'",
    )
)
register(
    BackendSpec(
        name="native",
        module="warmkv.backends.native",
        requires=("torch", "tokenizers", "gguf"),
        install_hint="pip install 'warmkv[native]' (torch==2.13.0, tokenizers, gguf, safetensors)",
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


def load_backend(name: str, model_path: str, config: RuntimeConfig, **kwargs: object) -> Backend:
    """Import the backend by name and load the model into it."""
    spec = _REGISTRY.get(name)
    if spec is None:
        raise BackendUnavailable(f"unknown backend {name!r}; registered: {', '.join(_REGISTRY)}")
    missing = _missing(spec)
    if missing:
        raise BackendUnavailable(
            f"backend {name!r} needs {', '.join(missing)}, which is not installed: {spec.install_hint}"
        )
    try:
        module = importlib.import_module(spec.module)
    except ImportError as e:
        raise BackendUnavailable(f"backend {name!r} failed to import: {e}; {spec.install_hint}") from e
    allowed = getattr(module, "OPTIONS", frozenset())
    unknown = sorted(set(kwargs) - set(allowed))
    if unknown:
        raise InvalidConfig(f"backend {name!r} has no option(s) {unknown}; valid: {sorted(allowed)}")
    loader: Callable[..., Backend] = module.load
    return loader(model_path, config, **kwargs)


__all__ = [
    "Backend",
    "BackendSpec",
    "ForwardRow",
    "ModelInfo",
    "ModelState",
    "available_backends",
    "load_backend",
    "register",
    "registered_backends",
]
