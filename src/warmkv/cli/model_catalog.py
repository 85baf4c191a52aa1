"""The models `warmkv serve` can serve and `warmkv models` lists.

Where they come from, in order: the -m models (the first is the default), a --models-dir
(GGUF files, and Hugging Face model folders: a folder with a config.json), and a
--models-preset TOML file whose tables name a model each, with its own options:

    [models.gemma]
    model = "gemma3-270m"          # a path, or a bundled name
    aliases = ["gemma3", "small"]
    num_ctx = 8192                 # any `warmkv serve` model option, by its flag name
    backend = "llamacpp"

A preset table whose id is already listed replaces that model's options.
"""

from __future__ import annotations

import contextlib
import json
import os
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..engine.runtime import Runtime
from ..errors import InvalidConfig, ModelNotFound
from ..models import MODEL_NAMES, default_model_path, gemma3_path, resolve_model
from ..server.models.table import ModelSpec
from .options import RuntimeOptions


@dataclass(frozen=True)
class Found:
    """A model file or folder on this machine."""

    id: str
    path: Path
    source: str  # bundled, models-dir, hf-cache, given

    @property
    def size_bytes(self) -> int:
        if self.path.is_dir():
            return sum(f.stat().st_size for f in self.path.rglob("*") if f.is_file())
        return self.path.stat().st_size

    @property
    def architecture(self) -> str:
        try:
            if self.path.is_dir():
                cfg = json.loads((self.path / "config.json").read_text(encoding="utf-8"))
                return str(cfg.get("model_type") or (cfg.get("architectures") or ["?"])[0])
            from ..backends.gguf_header import NotGGUF, read_header

            # the scalars up to the architecture only: gguf's reader parses every array first
            # (a 262K-token vocabulary took 22 s), and the architecture comes first in the file
            meta = read_header(self.path, stop=lambda m: "general.architecture" in m).meta
            return str(meta.get("general.architecture", "?"))
        except (OSError, ValueError, KeyError, IndexError, NotGGUF):
            return "?"


def scan_dir(directory: str | os.PathLike[str], source: str = "models-dir") -> list[Found]:
    """GGUF files and Hugging Face model folders directly in directory."""
    root = Path(directory).expanduser()
    if not root.is_dir():
        raise InvalidConfig(f"models directory {str(root)!r} is not a directory")
    out = []
    for p in sorted(root.iterdir()):
        if p.is_file() and p.suffix == ".gguf":
            out.append(Found(p.stem, p, source))
        elif p.is_dir() and (p / "config.json").is_file():
            out.append(Found(p.name, p, source))
    return out


def hf_cache() -> list[Found]:
    """Model snapshots in the Hugging Face hub cache (HF_HUB_CACHE, HF_HOME, or ~/.cache/huggingface/hub)."""
    root = Path(
        os.environ.get("HF_HUB_CACHE") or Path(os.environ.get("HF_HOME", "~/.cache/huggingface")) / "hub"
    ).expanduser()
    out = []
    for repo in sorted(root.glob("models--*")):
        snaps = sorted((repo / "snapshots").glob("*"), key=lambda p: p.stat().st_mtime)
        if snaps and (snaps[-1] / "config.json").is_file():
            out.append(Found(repo.name.removeprefix("models--").replace("--", "/"), snaps[-1], "hf-cache"))
    return out


def bundled() -> list[Found]:
    out = [Found(default_model_path().stem, default_model_path(), "bundled")]
    with contextlib.suppress(ModelNotFound):
        out.append(Found(MODEL_NAMES[1], gemma3_path(), "bundled"))
    return out


def _spec(model_id: str, opts: RuntimeOptions, aliases: tuple[str, ...] = ()) -> ModelSpec:
    config, options = opts.config(), opts.backend_options()  # InvalidConfig before serving
    path = str(resolve_model(opts.model))

    def load() -> Runtime:
        return Runtime.load(path, backend=opts.backend, config=config, backend_options=options)

    return ModelSpec(model_id, path, load, aliases, backend=opts.backend)


def serve_specs(
    opts: RuntimeOptions,
    *,
    model_id: str | None = None,
    aliases: tuple[str, ...] = (),
    models_dir: str | None = None,
    preset: str | None = None,
) -> list[ModelSpec]:
    """The models one server serves, the default first; InvalidConfig names a bad entry."""
    first = resolve_model(opts.model)
    specs: dict[str, ModelSpec] = {}
    default_id = model_id or (first.name if first.is_dir() else first.stem)  # "Qwen2.5-0.5B-Instruct", not "Qwen2.5-0"
    bundled_name = MODEL_NAMES[0] if opts.model is None else opts.model if opts.model in MODEL_NAMES else None
    given = tuple(a for a in aliases if a != "*") + ((bundled_name,) if bundled_name else ())
    specs[default_id] = _spec(default_id, opts, given)
    paths = {str(first)}

    def add(mid: str, p: Path, given: str) -> None:
        if str(p) in paths:
            return  # the same file twice: one model
        if mid in specs:
            raise InvalidConfig(
                f"two models would be called {mid!r}: {specs[mid].path} and {p}; "
                "serve one of them from a --models-preset table with another id"
            )
        specs[mid] = _spec(mid, opts.for_model(given))
        paths.add(str(p))

    for m in opts.more_models:
        p = resolve_model(m)
        add(m if m in MODEL_NAMES else p.stem if p.is_file() else p.name, p, m)  # a bundled model by its name
    if models_dir is not None:
        for f in scan_dir(models_dir):
            add(f.id, f.path, str(f.path))
    for mid, table in _preset(preset).items():
        table = dict(table)
        model = table.pop("model", None)
        if model is None and mid in specs:
            model = specs[mid].path
        if not isinstance(model, str):
            raise InvalidConfig(f'models preset: [models.{mid}] needs model = "PATH"')
        extra = table.pop("aliases", [])
        if not isinstance(extra, list) or not all(isinstance(a, str) and a for a in extra):
            raise InvalidConfig(f"models preset: [models.{mid}] aliases must be a list of names")
        kept = specs[mid].aliases if mid in specs else ()  # a preset adds names, it never takes one away
        specs[mid] = _spec(mid, opts.for_model(model, **table), tuple(dict.fromkeys((*kept, *extra))))
    return list(specs.values())


def _preset(path: str | None) -> dict[str, dict[str, Any]]:
    if path is None:
        return {}
    try:
        data = tomllib.loads(Path(path).expanduser().read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, tomllib.TOMLDecodeError) as e:
        raise InvalidConfig(f"models preset {path}: {e}") from None
    models = data.get("models", {})
    if not isinstance(models, dict) or not all(isinstance(v, dict) for v in models.values()):
        raise InvalidConfig(f"models preset {path}: expected [models.ID] tables")
    return models


def catalog(models_dir: str | None = None) -> list[Found]:
    """What a server here can load: the bundled models, a models directory, the Hugging Face cache."""
    found = bundled()
    if models_dir is not None:
        found += scan_dir(models_dir)
    return found + hf_cache()
