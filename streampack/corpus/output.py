"""Where ``corpus build`` and ``corpus merge`` write: a local directory or a store's
folder (a URL, through fsspec and :mod:`.storage`'s retried calls), one whole object
at a time.

A reader opens a corpus by its manifest, so a build writes every other object first
and the manifest (or a part's record) last: until that object exists there is no
corpus to read, and once it exists every file it names is complete. A local file is
written to a temporary name and renamed into place; a store's object is one PUT,
which the store makes visible whole.
"""

from __future__ import annotations

import io
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

from streampack.corpus import storage
from streampack.corpus.storage import CorpusPath, Url
from streampack.errors import InvalidConfig


class Output:
    """A folder being written: ``put`` an object whole, ``exists``, ``read``, ``remove``."""

    def __init__(self, root: CorpusPath) -> None:
        self.root = root

    def __str__(self) -> str:
        return str(self.root)

    def child(self, name: str) -> Output:
        return Output(self.root / name)

    def make(self) -> None:
        """Create the folder (a store's folders exist as soon as an object is in them)."""
        if isinstance(self.root, Path):
            try:
                self.root.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise InvalidConfig(f"cannot create --out {str(self.root)!r}: {exc}") from None

    def put(self, name: str, write: Callable[[IO[bytes]], object]) -> None:
        """The object ``name``, its bytes what ``write(file)`` writes, made visible whole."""
        target = self.root / name
        if isinstance(target, Url):
            buffer = io.BytesIO()
            write(buffer)
            data = buffer.getvalue()
            target.store.call(
                target, "write", lambda: target.store.fs.pipe_file(target.address, data)
            )
            return
        partial = target.with_name(f".{target.name}.partial")
        try:
            with open(partial, "wb") as handle:
                write(handle)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)

    def put_bytes(self, name: str, data: bytes) -> None:
        self.put(name, lambda handle: handle.write(data))

    def exists(self, name: str) -> bool:
        return storage.exists(self.root / name)

    def read(self, name: str, what: str) -> bytes:
        return storage.read_bytes(self.root / name, what)

    def remove(self, name: str) -> None:
        """``name`` gone (nothing when it is not there)."""
        target = self.root / name
        if isinstance(target, Url):
            if target.store.exists(target):
                target.store.call(target, "remove", lambda: target.store.fs.rm_file(target.address))
        else:
            target.unlink(missing_ok=True)
