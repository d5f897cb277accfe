"""The node-local cache of remote corpus files: fixed-size blocks on a local disk.

One directory, shared by every streampack process of the node that names it
(``corpus_cache_dir``; without one, a temporary directory of this process)::

    DIR/ab/abcdef.../17          block 17 of one object version (its key: URL, ETag, size)
    DIR/ab/abcdef.../17.claim    a process is fetching block 17 (O_EXCL; stale after
                                 STALE_AFTER seconds, so a crashed fetcher blocks no one)

A block is written to a temporary name and renamed into place (a reader never sees a
partial block) and is read back only at its expected size. The key holds the object's
ETag, so a changed object never reads the old one's blocks (and its reads are refused:
``storage.RemoteFile.changed``). Two processes asking for the same block: the first
claims it and fetches, the other waits for the block to appear — it is downloaded once.

The directory stays under ``cache_bytes`` (plus the blocks of the reads in progress, and
a tenth of the limit written between two counts): when it is over, blocks are evicted
until it is at 90%. The order is the reading order's, which is known (Belady's choice:
the block needed latest goes first). The cut tells the cache which blocks the windows
it produces next will read, in order (``plan``, through the prefetch); a block with no
such plan is needed later than every planned one — read already this epoch, it comes
back only in a later one, and of those the most recently read comes back last (a
repeating order: least-recently-used would miss every block of a cyclic scan) — so
those go first, most recently read first, then the planned blocks, the latest planned
first. Blocks a read in progress holds are kept. A cache smaller than the corpus still
gives the exact stream: a block evicted is fetched again.

A cached block is read as a memory map of its file (no request, no copy of the block:
the window's pieces are copied out of the page cache).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import functools
import mmap
import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class RemoteFile(Protocol):
    """What the cache needs of a remote file (``storage.RemoteFile``; named here so the
    cache imports nothing of the storage that holds it)."""

    key: str  # its URL, ETag and size, hashed
    size: int
    block: int
    store: Any  # its store: ``map(jobs)`` runs range requests, bounded in number

    def fetch_run(self, first: int, count: int) -> list[memoryview]: ...


#: A claim older than this (seconds) is abandoned: its process died or hung.
STALE_AFTER = 30.0
_POLL = 0.005
_RUN_BYTES = 64 << 20  # one range request fetches at most this many consecutive blocks


def _runs(indices: list[int], most: int) -> list[tuple[int, int]]:
    """``(first, count)`` of each run of consecutive ``indices`` (sorted), at most
    ``most`` long."""
    out: list[tuple[int, int]] = []
    for i in indices:
        if out and out[-1][0] + out[-1][1] == i and out[-1][1] < most:
            out[-1] = (out[-1][0], out[-1][1] + 1)
        else:
            out.append((i, 1))
    return out


class BlockCache:
    """Blocks of remote files in ``directory`` (see module), at most ``limit`` bytes."""

    def __init__(self, directory: str | None, limit: int, counters: Any) -> None:
        if directory is None:
            directory = tempfile.mkdtemp(prefix="streampack-cache-")
            atexit.register(shutil.rmtree, directory, ignore_errors=True)
        self.root = Path(directory)
        self.root.mkdir(parents=True, exist_ok=True)
        self._root = str(self.root)
        self.limit = limit
        self.counters = counters
        self._lock = threading.Lock()
        self._written = 0  # bytes this process wrote since it last counted the directory
        self._held: dict[str, int] = {}  # block path -> readers holding it (not evicted)
        # Block path -> when this process will read it, each planned read in turn (the
        # windows the cut will produce next, told by ``plan``; two windows may share a
        # block): the eviction order's known future.
        self._planned: dict[str, collections.deque[int]] = {}
        self._clock = 0
        # Block path -> its bytes, for the blocks this process fetched ahead and has not
        # read yet: their sum is the prefetch depth (``prefetch_ahead_bytes``).
        self._ahead: dict[str, int] = {}

    def plan(self, file: RemoteFile, indices: list[int]) -> None:
        """Blocks ``indices`` of ``file`` will be read next, after those planned before."""
        with self._lock:
            self._clock += 1
            for i in indices:
                self._planned.setdefault(self._name(file, i), collections.deque()).append(
                    self._clock
                )

    def _path(self, file: RemoteFile, index: int) -> Path:
        return Path(self._name(file, index))

    def _name(self, file: RemoteFile, index: int) -> str:
        """The block's file name as a string (built per block of every read: no Path)."""
        return f"{self._root}{os.sep}{file.key[:2]}{os.sep}{file.key}{os.sep}{index}"

    def _expected(self, file: RemoteFile, index: int) -> int:
        return min(file.size, (index + 1) * file.block) - index * file.block

    def _read(self, file: RemoteFile, index: int) -> np.ndarray | None:
        """The cached block, memory-mapped (no copy: a window's pieces are copied
        straight out of the page cache), or None."""
        path = self._name(file, index)
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            size = os.fstat(fd).st_size
            if size != self._expected(file, index):  # not ours to trust: fetch again
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(path)
                return None
            if size == 0:
                return np.zeros(0, np.uint8)
            data = np.frombuffer(mmap.mmap(fd, size, access=mmap.ACCESS_READ), np.uint8)
            try:
                os.utime(fd)  # read now: the eviction order's clock (shared by processes)
            except OSError:
                pass
            return data
        finally:
            os.close(fd)

    def _present(self, file: RemoteFile, index: int) -> bool:
        try:
            return os.stat(self._name(file, index)).st_size == self._expected(file, index)
        except FileNotFoundError:
            return False

    def _write(self, file: RemoteFile, index: int, data: Any, ahead: bool = False) -> None:
        path = self._path(file, index)
        path.parent.mkdir(parents=True, exist_ok=True)
        temporary = path.with_name(f".{index}.{os.getpid()}.{threading.get_ident()}.tmp")
        temporary.write_bytes(data)
        if ahead:  # fetched ahead, not read yet: last in the eviction order
            os.utime(temporary, (0, 0))
        with self._lock:  # counted before a reader can see it, so its read uncounts it
            self._written += len(data)
            if ahead and str(path) not in self._ahead:
                self._ahead[str(path)] = len(data)
                self.counters.prefetch_ahead_bytes += len(data)
        os.replace(temporary, path)  # atomic: a reader sees all of the block or none

    def _claim(self, file: RemoteFile, index: int) -> bool:
        """Whether this process now holds the right to fetch the block (an abandoned
        claim is taken over)."""
        claim = self._claim_path(file, index)
        claim.parent.mkdir(parents=True, exist_ok=True)
        for _ in range(2):
            try:
                os.close(os.open(claim, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
                return True
            except FileExistsError:
                try:
                    if time.time() - claim.stat().st_mtime < STALE_AFTER:
                        return False
                    claim.unlink()
                except FileNotFoundError:
                    pass
        return False

    def _claim_path(self, file: RemoteFile, index: int) -> Path:
        path = self._path(file, index)
        return path.with_name(path.name + ".claim")

    def _release(self, file: RemoteFile, index: int) -> None:
        self._claim_path(file, index).unlink(missing_ok=True)

    def _wait(self, file: RemoteFile, index: int) -> np.ndarray | None:
        """The block another process is fetching, once it is there; None when its
        claim went away without it (the fetch failed) or went stale."""
        claim = self._claim_path(file, index)
        deadline = time.monotonic() + STALE_AFTER
        while time.monotonic() < deadline:
            data = self._read(file, index)
            if data is not None:
                return data
            if not claim.exists():
                return self._read(file, index)
            time.sleep(_POLL)
        return None

    def blocks(
        self, file: RemoteFile, indices: list[int], ahead: bool = False
    ) -> dict[int, np.ndarray]:
        """Blocks ``indices`` (sorted, distinct) of ``file``: cached ones read, missing
        ones fetched once on the node (claimed; runs of consecutive blocks in one range
        request each, at most ``max_requests`` at once), then written here. ``ahead``:
        fetched for a later read (prefetch), so not marked read."""
        held = [self._name(file, i) for i in indices]
        self._hold(held, 1)
        try:
            out: dict[int, np.ndarray] = {}
            missing = []
            for i in indices:
                if ahead:  # only what is not here yet: nothing read now
                    if not self._present(file, i):
                        missing.append(i)
                    continue
                data = self._read(file, i)
                if data is None:
                    missing.append(i)
                else:
                    out[i] = data
            if not ahead:
                self._count(cache_hits=len(out), cache_misses=len(missing))
                with self._lock:  # read now: its next planned read is done
                    for path in held:
                        uses = self._planned.get(path)
                        if uses:
                            uses.popleft()
                        if not uses:
                            self._planned.pop(path, None)
            if missing:
                self._fetch(file, missing, out, ahead)
            if not ahead:  # read now (found, or fetched ahead while this read waited)
                with self._lock:
                    for path in held:
                        self.counters.prefetch_ahead_bytes -= self._ahead.pop(path, 0)
        finally:
            self._hold(held, -1)
        self._evict_if_full()
        return out

    def _fetch(
        self, file: RemoteFile, missing: list[int], out: dict[int, np.ndarray], ahead: bool
    ) -> None:
        claimed: list[int] = []
        others: list[int] = []
        for i in missing:
            if not self._claim(file, i):
                others.append(i)
                continue
            # Looked again under the claim: another fetcher (this process's prefetch, or
            # another process) may have written it and let go between the miss and now.
            data = self._read(file, i)
            if data is None:
                claimed.append(i)
            else:
                self._release(file, i)
                out[i] = data
        try:
            # Few large requests, but at least as many as may run at once (a window's
            # blocks fetched in parallel rather than as one long response).
            spread = -(-len(claimed) // file.store.options.max_requests)
            # (Shorter runs ahead, for the nearest blocks to arrive first, measured
            # slower on loopback: a request's overhead outweighs the earlier arrival.)
            runs = _runs(claimed, max(1, min(_RUN_BYTES // file.block, spread)))
            jobs: list[Callable[[], list[memoryview]]] = [
                functools.partial(file.fetch_run, first, count) for first, count in runs
            ]
            for (first, _), pieces in zip(runs, file.store.map(jobs), strict=True):
                for k, data in enumerate(pieces):
                    self._write(file, first + k, data, ahead)
                    out[first + k] = np.frombuffer(data, np.uint8)
        finally:
            for i in claimed:
                self._release(file, i)
        for i in others:
            waited = self._wait(file, i)
            if waited is None:  # the other fetcher failed or hung: fetch it here
                fetched = file.fetch_run(i, 1)[0]
                self._write(file, i, fetched, ahead)
                waited = np.frombuffer(fetched, np.uint8)
            out[i] = waited

    def _hold(self, paths: list[str], step: int) -> None:
        with self._lock:
            for path in paths:
                count = self._held.get(path, 0) + step
                if count > 0:
                    self._held[path] = count
                else:
                    self._held.pop(path, None)

    def _count(self, **added: int) -> None:
        with self._lock:
            for name, value in added.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)

    def _evict_if_full(self) -> None:
        """Count the directory when this process wrote enough to maybe fill it, and
        evict (module docstring) down to 90% of the limit when it is over."""
        with self._lock:
            if self._written < self.limit // 10 and self._written < (64 << 20):
                return
            self._written = 0
        blocks: list[tuple[float, int, str]] = []
        used = 0
        for entry in _files(self.root):
            if entry.name.endswith((".claim", ".tmp")):
                continue
            try:
                stat = entry.stat()
            except FileNotFoundError:
                continue
            used += stat.st_size
            blocks.append((stat.st_mtime, stat.st_size, entry.path))
        if used <= self.limit:
            return
        with self._lock:
            held = set(self._held)
            planned = {path: uses[0] for path, uses in self._planned.items()}
        # The block needed latest goes first: one this process has no plan for (read
        # already this epoch, or another process's) before any planned one, the most
        # recently read of those first (in a repeating order it comes back last); then
        # the planned ones, the latest planned first.
        blocks.sort(key=lambda b: (-planned.get(b[2], 0), -b[0]))
        blocks.sort(key=lambda b: b[2] in planned)
        target = self.limit * 9 // 10
        evicted = 0
        for _, size, path in blocks:
            if used <= target:
                break
            if path in held:
                continue
            try:
                os.unlink(path)
            except FileNotFoundError:
                continue
            used -= size
            evicted += 1
            with self._lock:  # fetched ahead and gone before it was read
                self.counters.prefetch_ahead_bytes -= self._ahead.pop(path, 0)
        self._count(cache_evictions=evicted)


def _files(root: Path) -> list[Any]:
    """Every entry two folders below ``root`` (the blocks and their claims)."""
    out: list[Any] = []
    for top in os.scandir(root):
        if not top.is_dir():
            continue
        for key in os.scandir(top.path):
            if key.is_dir():
                out.extend(os.scandir(key.path))
    return out
