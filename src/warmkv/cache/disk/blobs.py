"""Blob files of the store: atomic writes, reads, and removal of leftovers of killed writers.

A blob becomes visible under its final name only by rename(2) after its bytes
were fsynced, and the rename itself is made durable by fsyncing the directory.
Final names are unique per write, so files are immutable once renamed.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from pathlib import Path

from .container import BlobHeader, write_container

SUFFIX = ".wkv"
TMP_PREFIX = ".tmp-"


def fsync_dir(directory: Path) -> None:
    if os.name == "nt":  # directories cannot be opened for fsync there; rename is durable enough
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_blob(directory: Path, header: BlobHeader, payload: bytes | memoryview) -> tuple[str, int, int]:
    """Durably write a container under a fresh name; return (file name, size, crc32c)."""
    token = secrets.token_hex(12)
    tmp = directory / f"{TMP_PREFIX}{os.getpid()}-{token}"
    name = f"{token}{SUFFIX}"
    try:
        with open(tmp, "xb") as f:
            size, crc = write_container(f, header, payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, directory / name)
        fsync_dir(directory)
    except BaseException:
        unlink_quiet(tmp)
        unlink_quiet(directory / name)
        raise
    return name, size, crc


def read_blob(directory: Path, name: str) -> bytes:
    with open(directory / name, "rb") as f:
        return f.read()


def unlink_quiet(path: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        path.unlink()


def _pid_alive(pid: int) -> bool:
    if os.name == "nt":
        return True  # unknown there: fall back to the age rule
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_leftovers(directory: Path, indexed: set[str], stale_after_s: float) -> int:
    """Remove temp files of dead writers and old blobs no index row points to; return the count.

    A young unindexed blob may belong to a live writer between rename and commit, so
    it is kept until stale_after_s; it is never served meanwhile (no index row).
    """
    now = time.time()
    removed = 0
    for path in directory.iterdir():
        name = path.name
        try:
            age = now - path.stat().st_mtime
        except FileNotFoundError:
            continue
        if name.startswith(TMP_PREFIX):
            pid_text = name[len(TMP_PREFIX) :].split("-", 1)[0]
            dead = pid_text.isdigit() and int(pid_text) != os.getpid() and not _pid_alive(int(pid_text))
            if dead or age > stale_after_s:
                unlink_quiet(path)
                removed += 1
        elif name.endswith(SUFFIX) and name not in indexed and age > stale_after_s:
            unlink_quiet(path)
            removed += 1
    return removed
