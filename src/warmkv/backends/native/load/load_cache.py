"""What a load derived from a GGUF, kept on disk so that the next load of the same file reads it back
instead of deriving it again.

A load of the default model (94 MB) spent ~3 s reading ~250K metadata fields, rebuilding the
tokenizer and its byte table, and re-packing every 4-bit matrix for qmatmul; a 1 GB file also
spent ~1 s on its sha256. Kept here, per model file:

    <root>/digests.json                       path -> (device, inode, size, mtime) -> sha256
    <root>/<sha256>/header.json               hyperparameters, tokenizer, template, metadata
    <root>/<sha256>/parts-<build>.safetensors the engine's matrices for one set of build choices

`build` digests the choices (compute dtype, weight-only quantization, the prefill copy, the device)
and the code that makes the parts, so a new warmkv or torch never reads an older layout. Files are
written whole under a temporary name and renamed; one that cannot be read is a miss, deleted, and
the load reads the GGUF. The root keeps within a byte budget (WARMKV_LOAD_CACHE_MB, default 20 GiB),
evicting the models least recently loaded; `rm -r` of it, or `load_cache="off"`, is always safe.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import gguf
import safetensors
import safetensors.torch
import torch

from ....cache.disk.types import cache_root
from ....errors import InvalidConfig, InvalidModelFile
from ....manifest import file_digest
from ..model.args import ModelArgs
from ..model.parts import Parts
from .checkpoint import Checkpoint, Lazy
from .mapped import map_safetensors
from .tokenizer import TextTokenizer

log = logging.getLogger(__name__)
FORMAT = 1
DEFAULT_MB = 20 * 1024
_NATIVE = Path(__file__).resolve().parent.parent
_code: str | None = None


def code_digest() -> str:
    """The code that turns a checkpoint into parts (the loaders and the model's builders), torch's and
    gguf's versions: a change to any makes the cached files of other versions unreachable."""
    global _code
    if _code is None:
        h = hashlib.sha256(f"{FORMAT} {torch.__version__} {gguf.__name__}".encode())
        for f in sorted([*(_NATIVE / "load").glob("*.py"), *(_NATIVE / "model").glob("*.py")]):
            h.update(f.name.encode() + f.read_bytes())
        _code = h.hexdigest()[:16]
    return _code


def _no_file(name: str) -> torch.Tensor:
    raise InvalidModelFile(f"weight {name} read from a load cache's header, which holds no weights")


class LoadCache:
    """One directory of derived load files (see the module's docstring)."""

    def __init__(self, root: Path, budget_bytes: int) -> None:
        self.root, self.budget = root, budget_bytes

    @staticmethod
    def for_option(option: str) -> LoadCache | None:
        """The cache for the `load_cache` option: "off", "auto" ($WARMKV_LOAD_CACHE, which may say
        "off", else cache_root()/native, e.g. ~/.cache/warmkv/native) or a directory."""
        if option == "off":
            return None
        if option == "auto":
            env = os.environ.get("WARMKV_LOAD_CACHE")
            if env == "off":
                return None
            option = env or str(cache_root() / "native")
        raw = os.environ.get("WARMKV_LOAD_CACHE_MB", str(DEFAULT_MB))
        try:
            mb = int(raw)
        except ValueError:
            mb = -1
        if mb < 0:
            raise InvalidConfig(f"WARMKV_LOAD_CACHE_MB must be a whole number of MiB >= 0, got {raw!r}")
        return LoadCache(Path(option).expanduser(), mb << 20)

    # -- the file's digest --------------------------------------------------------

    def digest(self, path: Path) -> str:
        """sha256 of the file, remembered under its device, inode, size and mtime (a file rewritten in
        place keeps none of the four alike in practice; its old digest is then never used)."""
        st = path.stat()
        stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
        memo_path = self.root / "digests.json"
        memo = _read_json(memo_path) or {}
        key = str(path.resolve())
        got = memo.get(key)
        if isinstance(got, list) and got[:4] == stamp and isinstance(got[4], str):
            return got[4]
        digest = file_digest(path)
        memo[key] = [*stamp, digest]
        self._write(memo_path, lambda tmp: Path(tmp).write_text(json.dumps(memo)))
        return digest

    # -- hyperparameters, tokenizer, template ---------------------------------------

    def header(self, digest: str) -> Checkpoint | None:
        """The checkpoint's facts as a load of this file found them; its weights are not in it."""
        d = _read_json(self.root / digest / "header.json")
        if d is None or d.get("code") != code_digest():
            return None
        try:
            args = {k: tuple(v) if isinstance(v, list) else v for k, v in d["args"].items()}
            return Checkpoint(
                args=ModelArgs(**args),
                weights=Lazy({k: tuple(v) for k, v in d["shapes"].items()}, _no_file),
                tokenizer=TextTokenizer.restore(d["tokenizer"]),
                chat_template=d["chat_template"],
                name=d["name"],
                add_bos=d["add_bos"],
                metadata=d["metadata"],
                layer_weight_types=frozenset(d["layer_weight_types"]),
            )
        except Exception as e:  # a damaged or foreign file is a miss
            self._discard(self.root / digest / "header.json", e)
            return None

    def put_header(self, digest: str, ckpt: Checkpoint) -> None:
        d = {
            "code": code_digest(),
            "args": dataclasses.asdict(ckpt.args),
            "shapes": {k: ckpt.weights.shape(k) for k in ckpt.weights},
            "tokenizer": ckpt.tokenizer.state(),
            "chat_template": ckpt.chat_template,
            "name": ckpt.name,
            "add_bos": ckpt.add_bos,
            "metadata": ckpt.metadata,
            "layer_weight_types": sorted(ckpt.layer_weight_types),
        }
        self._write(self.root / digest / "header.json", lambda tmp: Path(tmp).write_text(json.dumps(d)))

    # -- the engine's matrices --------------------------------------------------------

    @staticmethod
    def build_key(**choices: object) -> str:
        text = json.dumps({"code": code_digest(), **choices}, sort_keys=True, default=str)
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    def parts(self, digest: str, build: str) -> Parts | None:
        path = self.root / digest / f"parts-{build}.safetensors"
        if not path.exists():
            return None
        try:
            tensors, meta = map_safetensors(path)
            parts = Parts.from_tensors(tensors, json.loads(meta["spec"]))
        except Exception as e:  # a damaged or foreign file: read the GGUF instead
            self._discard(path, e)
            return None
        os.utime(path.parent)  # the model's last load: the budget evicts the others first
        return parts

    def put_parts(self, digest: str, build: str, parts: Parts) -> None:
        tensors, spec = parts.tensors()
        meta = {"spec": json.dumps(spec)}
        path = self.root / digest / f"parts-{build}.safetensors"
        self._write(path, lambda tmp: safetensors.torch.save_file(tensors, tmp, metadata=meta))
        self._evict(keep=self.root / digest)

    # -- files ----------------------------------------------------------------------------

    def _write(self, path: Path, write: Callable[[str], object]) -> None:
        """Whole or not at all: written under a temporary name, then renamed into place. A full disk
        is a warning: the load goes on without the file."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            os.close(fd)
            try:
                write(tmp)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except (OSError, safetensors.SafetensorError) as e:
            log.warning("load cache: cannot write %s (%s); the next load reads the model file again", path, e)

    def _discard(self, path: Path, e: BaseException) -> None:
        log.warning("load cache: %s unreadable (%s: %s); reading the model file instead", path, type(e).__name__, e)
        path.unlink(missing_ok=True)

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())

    def _evict(self, keep: Path) -> None:
        """The models least recently loaded go first, until the root fits its budget."""
        models = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        total = self.size()
        for d in models:
            if total <= self.budget:
                return
            if d == keep:
                continue
            n = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
            total -= n
            log.info("load cache: evicted %s (%d MiB) to stay within %d MiB", d.name, n >> 20, self.budget >> 20)
        if total > self.budget:
            log.warning("load cache: %s alone is over the %d MiB budget; not kept", keep.name, self.budget >> 20)
            shutil.rmtree(keep, ignore_errors=True)


def _read_json(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None
