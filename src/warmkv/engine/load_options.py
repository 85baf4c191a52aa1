"""What `Runtime.load` is asked for, resolved before anything loads: the model file, the runtime's
config, the backend (chosen from the file when "auto") and its options.

Every unknown or conflicting option is an InvalidConfig or InvalidInput naming it, raised here,
before a byte of the model is read.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import fields
from pathlib import Path
from typing import Any

from ..backends import BackendOptions, available_backends, make_options, options_type
from ..backends.choose import AUTO, BackendChoice, choose_backend
from ..config import RuntimeConfig
from ..errors import InvalidConfig, InvalidInput
from ..models import resolve_model

log = logging.getLogger("warmkv.engine.runtime")  # the runtime's logger: a load's line keeps its name


def resolve(
    model: str | os.PathLike[str] | None,
    backend: str,
    config: RuntimeConfig | None,
    backend_options: BackendOptions | Mapping[str, Any] | None,
    options: Mapping[str, Any],
) -> tuple[Path, RuntimeConfig, BackendChoice, BackendOptions]:
    """(model path, runtime config, backend choice, backend options) for Runtime.load's arguments."""
    runtime_names = {f.name for f in fields(RuntimeConfig)}
    if backend == AUTO:
        backend_names = set(options_type("native").names()) | set(options_type("llamacpp").names())
    else:
        backend_names = set(options_type(backend).names())
    unknown = sorted(set(options) - runtime_names - backend_names)
    if unknown:
        valid = sorted(runtime_names | backend_names)
        raise InvalidConfig(f"unknown runtime option(s) {unknown} for backend {backend!r}; valid: {valid}")
    runtime_opts = {k: v for k, v in options.items() if k in runtime_names}
    if config is not None and runtime_opts:
        raise InvalidInput("pass either config= or keyword options, not both")
    cfg = config if config is not None else RuntimeConfig.from_kwargs(**runtime_opts)
    if not isinstance(cfg, RuntimeConfig):
        raise InvalidInput(f"config must be RuntimeConfig, got {type(cfg).__name__}")
    more = {k: v for k, v in options.items() if k in backend_names and k not in runtime_names}
    path = resolve_model(model)
    if backend == AUTO:
        given = backend_options.as_dict() if isinstance(backend_options, BackendOptions) else backend_options
        if given is not None and not isinstance(given, Mapping):
            raise InvalidConfig(f"backend options must be a mapping, got {type(given).__name__}")
        named = {**dict(given or {}), **more}
        choice = choose_backend(path, available_backends(), option_names=named, kv_cache_type=cfg.kv_cache_type)
        log.info("backend auto: %s (%s)", choice.name, choice.reason)
        opts = make_options(choice.name, named)
    else:
        choice = BackendChoice(backend, "asked for")
        opts = make_options(backend, backend_options, **more)
    return path, cfg, choice, opts
