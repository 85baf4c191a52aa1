"""What a load derives from a model file, kept on disk so that the next load of the same file reads it
back instead of deriving it again (the engines' own files are theirs: native/load/cached_build.py,
llamacpp/backend.py).

    <root>/digests.json                        path -> (device, inode, size, mtime) -> sha256
    <root>/<sha256>/header.json                native: hyperparameters, tokenizer, template, metadata
    <root>/<sha256>/parts-<code>-<choices>.safetensors  native: the engine's matrices, one build
    <root>/<sha256>/llamacpp.json              llama.cpp: the vocabulary's digest

A load of the default model (94 MB) spent ~3 s reading ~250K metadata fields, rebuilding the
tokenizer's byte table and repacking every 4-bit matrix; a llama.cpp load of Gemma 3 270M spent
~1 s hashing its 262K-token vocabulary and 0.2 s hashing its file. Files are written whole under a
temporary name and renamed; one that cannot be read is a miss, deleted, and the load reads the
model file. The root keeps within a byte budget (WARMKV_LOAD_CACHE_MB, default 20 GiB), evicting
the models least recently loaded; `rm -r` of it, or the option `load_cache="off"`, is always safe.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..cache.disk.types import cache_root
from ..errors import InvalidConfig
from ..manifest import file_digest

log = logging.getLogger(__name__)
DEFAULT_MB = 20 * 1024


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

    def digest(self, path: Path) -> str:
        """sha256 of the file, remembered under its device, inode, size and mtime (a file rewritten in
        place keeps none of the four alike in practice; its old digest is then never used)."""
        st = path.stat()
        stamp = [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns]
        memo_path = self.root / "digests.json"
        memo = read_json(memo_path) or {}
        key = str(path.resolve())
        got = memo.get(key)
        if isinstance(got, list) and got[:4] == stamp and isinstance(got[4], str):
            return got[4]
        digest = file_digest(path)
        memo[key] = [*stamp, digest]
        self.write_json(memo_path, memo)
        return digest

    def path(self, digest: str, name: str) -> Path:
        return self.root / digest / name

    def loaded(self, digest: str) -> None:
        """The model's last load: the budget evicts the others first."""
        with contextlib.suppress(OSError):
            os.utime(self.root / digest)

    def write(self, path: Path, write: Callable[[str], object], *errors: type[Exception]) -> None:
        """Whole or not at all: written under a temporary name, then renamed into place. A full disk
        (or one of `errors`, the writer's own) is a warning: the load goes on without the file."""
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".tmp-")
            os.close(fd)
            try:
                write(tmp)
                os.replace(tmp, path)
            finally:
                Path(tmp).unlink(missing_ok=True)
        except (OSError, *errors) as e:
            log.warning("load cache: cannot write %s (%s); the next load reads the model file again", path, e)

    def write_json(self, path: Path, doc: dict) -> None:
        self.write(path, lambda tmp: Path(tmp).write_text(json.dumps(doc)))

    def discard(self, path: Path, e: BaseException) -> None:
        log.warning("load cache: %s unreadable (%s: %s); reading the model file instead", path, type(e).__name__, e)
        path.unlink(missing_ok=True)

    def size(self) -> int:
        return sum(f.stat().st_size for f in self.root.rglob("*") if f.is_file())

    def evict(self, keep: str) -> None:
        """The models least recently loaded go first, until the root fits its budget; `keep` (a digest)
        last, and only when it alone is over the budget."""
        kept = self.root / keep
        models = sorted((d for d in self.root.iterdir() if d.is_dir()), key=lambda d: d.stat().st_mtime)
        total = self.size()
        for d in models:
            if total <= self.budget:
                return
            if d == kept:
                continue
            n = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
            shutil.rmtree(d, ignore_errors=True)
            total -= n
            log.info("load cache: evicted %s (%d MiB) to stay within %d MiB", d.name, n >> 20, self.budget >> 20)
        if total > self.budget:
            log.warning("load cache: %s alone is over the %d MiB budget; not kept", keep, self.budget >> 20)
            shutil.rmtree(kept, ignore_errors=True)


def read_json(path: Path) -> dict | None:
    try:
        with open(path, "rb") as f:
            d = json.loads(f.read())
        return d if isinstance(d, dict) else None
    except (OSError, ValueError):
        return None
