"""Shared by the readers and the build: file checks (regular files only, names kept
inside the corpus; a URL's through :mod:`.storage`), a file's SHA-256 and the cores
this process may use."""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import overload

from streampack.corpus.storage import CorpusPath, Url, inside_url, open_binary
from streampack.errors import InvalidConfig


def file_sha256(path: CorpusPath) -> str:
    """The SHA-256 of a file's bytes, local or a store's object."""
    digest = hashlib.sha256()
    with open_binary(path, "input file") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def usable_cores() -> int:
    """Cores this process may run on (its affinity, where the system keeps one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@overload
def regular_file(path: Path, what: str) -> Path: ...
@overload
def regular_file(path: Url, what: str) -> Url: ...
@overload
def regular_file(path: CorpusPath, what: str) -> CorpusPath: ...


def regular_file(path: CorpusPath, what: str) -> CorpusPath:
    """``path`` if it is an existing regular file (a FIFO or device would block or
    never end a read), else a clear error naming it. A URL: an object of its store."""
    if isinstance(path, Url):
        info = path.store.info(path)  # a missing object: one line naming it
        if info.get("type") == "directory":
            raise InvalidConfig(f"{what} {str(path)!r} is a folder; expected a file")
        return path
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise InvalidConfig(f"{what} {str(path)!r} does not exist") from None
    except OSError as exc:
        raise InvalidConfig(f"cannot read {what} {str(path)!r}: {exc}") from exc
    if not stat.S_ISREG(mode):
        raise InvalidConfig(
            f"{what} {str(path)!r} is not a regular file (a FIFO, device or directory); "
            f"expected a regular file"
        )
    return path


@overload
def inside(root: Path, name: str, what: str, *, allow_outside: bool) -> Path: ...
@overload
def inside(root: Url, name: str, what: str, *, allow_outside: bool) -> Url: ...
@overload
def inside(root: CorpusPath, name: str, what: str, *, allow_outside: bool) -> CorpusPath: ...


def inside(root: CorpusPath, name: str, what: str, *, allow_outside: bool) -> CorpusPath:
    """``root / name``, refused when ``name`` is absolute or leads outside ``root``
    (``..``, or a symbolic link pointing out) unless ``allow_outside``: a manifest
    must not make the service read files it was not pointed at."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise InvalidConfig(f"{what} name {name!r} must be a non-empty path string")
    if isinstance(root, Url):
        return inside_url(root, name, what, allow_outside=allow_outside)
    path = root / name
    if allow_outside:
        return path
    if Path(name).is_absolute():
        raise InvalidConfig(
            f"{what} {name!r} is an absolute path; names in a manifest are relative to "
            f"the corpus directory {str(root)!r} (set corpus_allow_outside to allow this)"
        )
    resolved_root = root.resolve()
    if not path.resolve().is_relative_to(resolved_root):
        raise InvalidConfig(
            f"{what} {name!r} leads outside the corpus directory {str(root)!r}; names in a "
            f"manifest stay inside it (set corpus_allow_outside to allow this)"
        )
    return path
