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
the window's pieces are copied out of the page cache). Where the block size is a
multiple of the page size (Linux), each process maps the blocks it reads side by side
into one reserved range of address space per remote file (:class:`_Mapping`): the file
then reads as one array, as a local file's memory map does — one compiled gather per
window, and a block read before costs a lookup in that process (no open, stat, claim,
lock file or request). What it last read there is this process's own clock for the
eviction order; a block it evicts, or finds evicted by another process, is unmapped
(its disk space freed) once no read holds it.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import functools
import mmap
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
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


# mmap(2) through ctypes: the mmap module cannot place a map at an address (MAP_FIXED).
_MAP_FIXED = 0x10  # Linux's value on every architecture it runs on
_MAP_NORESERVE = 0x4000
_PROT_NONE = 0  # (the mmap module names PROT_READ only)
_FAILED = ctypes.c_void_p(-1).value


def _libc_mmap() -> Any:
    if not sys.platform.startswith("linux"):
        return None
    try:
        call = ctypes.CDLL(None, use_errno=True).mmap
    except (OSError, AttributeError):
        return None
    call.restype = ctypes.c_void_p
    call.argtypes = [
        ctypes.c_void_p,
        ctypes.c_size_t,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_int,
        ctypes.c_long,
    ]
    return call


_MMAP = _libc_mmap()


class _Mapping:
    """One remote file's cached blocks mapped side by side, block ``i`` at ``i * block``
    of one reserved range of address space (inaccessible where no block is mapped):
    ``array`` is the whole file, readable where ``present``. ``held[i]``: reads in
    progress that use block ``i`` (it stays mapped); ``read_at[i]``: when this process
    last read it (the eviction order's clock, without a ``utime`` per read)."""

    def __init__(self, size: int, block: int) -> None:
        count = -(-size // block)
        self.block = block
        self.base = self._call(None, count * block, _PROT_NONE, _private())
        self.present = np.zeros(count, bool)
        self.held = np.zeros(count, np.int64)
        self.read_at = np.zeros(count, np.float64)
        self.array = np.frombuffer(
            memoryview((ctypes.c_uint8 * size).from_address(self.base)), np.uint8
        )
        self.array.flags.writeable = False

    @staticmethod
    def _call(address: int | None, length: int, protection: int, flags: int, fd: int = -1) -> int:
        got = _MMAP(address, length, protection, flags, fd, 0)
        if got in (None, _FAILED):
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))
        return int(got)

    def map(self, index: int, path: str, expected: int) -> bool:
        """Map block ``index`` from its cache file (False: not there at its size)."""
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            return False
        try:
            if os.fstat(fd).st_size != expected:
                return False
            address = self.base + index * self.block
            self._call(address, expected, mmap.PROT_READ, mmap.MAP_SHARED | _MAP_FIXED, fd)
        finally:
            os.close(fd)
        self.present[index] = True
        return True

    def unmap(self, index: int) -> None:
        """Block ``index`` made inaccessible again (its file's pages let go)."""
        self.present[index] = False
        address = self.base + index * self.block
        self._call(address, self.block, _PROT_NONE, _private() | _MAP_FIXED)


def _private() -> int:
    return mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_NORESERVE


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
        # Remote file key -> its blocks mapped side by side (None: not mappable so).
        self._maps: dict[str, _Mapping | None] = {}

    def _mapping(self, file: RemoteFile) -> _Mapping | None:
        with self._lock:
            if file.key not in self._maps:
                mappable = _MMAP is not None and file.size > 0 and file.block % mmap.PAGESIZE == 0
                try:
                    self._maps[file.key] = _Mapping(file.size, file.block) if mappable else None
                except OSError:  # no address space for it: blocks read one by one
                    self._maps[file.key] = None
            return self._maps[file.key]

    @contextlib.contextmanager
    def mapped(self, file: RemoteFile, indices: np.ndarray) -> Iterator[np.ndarray | None]:
        """The whole of ``file`` as one uint8 array in which blocks ``indices`` (sorted,
        distinct) can be read while the ``with`` lasts — those this process mapped
        before found with no system call at all, the others fetched or read from the
        cache (``blocks``) and mapped first. None where the file's blocks are not
        mapped so (see module): the caller reads ``blocks``."""
        mapping = self._mapping(file)
        if mapping is None:
            yield None
            return
        indices = np.asarray(indices, np.int64)
        with self._lock:
            mapping.held[indices] += 1
            here = mapping.present[indices]
        hits, missing = indices[here], indices[~here]
        try:
            if missing.size and not self._map_missing(file, mapping, missing.tolist()):
                yield None
                return
            self._count(cache_hits=len(hits))
            with self._lock:
                mapping.read_at[indices] = time.time()
                if self._planned:  # read now: each hit's next planned read is done
                    for i in hits.tolist():  # (``blocks`` did the missing ones')
                        self._done(self._name(file, i))
            yield mapping.array
        finally:
            with self._lock:
                mapping.held[indices] -= 1

    def _map_missing(self, file: RemoteFile, mapping: _Mapping, missing: list[int]) -> bool:
        """Blocks ``missing`` fetched (or read from the cache) and mapped; False when one
        went away again before it was mapped, three times (evicted by another process
        each time: the caller then reads the blocks as they came)."""
        for _ in range(3):
            self.blocks(file, missing)
            missing = [
                i
                for i in missing
                if not mapping.map(i, self._name(file, i), self._expected(file, i))
            ]
            if not missing:
                return True
        return False

    def _done(self, path: str) -> None:
        """The next planned read of block ``path`` happened (the lock is held)."""
        uses = self._planned.get(path)
        if uses:
            uses.popleft()
        if not uses:
            self._planned.pop(path, None)

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
        mapping = self._maps.get(file.key)
        try:
            out: dict[int, np.ndarray] = {}
            missing = []
            for i in indices:
                if ahead:  # only what is not here yet: nothing read now
                    if mapping is not None and mapping.present[i]:
                        continue
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
                        self._done(path)
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
        self._unmap_gone({path for _, _, path in blocks})
        if used <= self.limit:
            return
        with self._lock:
            held = set(self._held)
            planned = {path: uses[0] for path, uses in self._planned.items()}
            # A block this process maps was last read when its mapping says (no utime).
            blocks = [
                (max(mtime, self._mapped_at(path)), size, path) for mtime, size, path in blocks
            ]
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
            if path in held or not self._unmap(path):
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

    def _mapped_block(self, path: str) -> tuple[_Mapping, int] | None:
        """The mapping of the file of the block at ``path``, and its index."""
        key, name = path.rsplit(os.sep, 2)[-2:]
        mapping = self._maps.get(key)
        return None if mapping is None or not name.isdigit() else (mapping, int(name))

    def _mapped_at(self, path: str) -> float:
        found = self._mapped_block(path)
        return 0.0 if found is None else float(found[0].read_at[found[1]])

    def _unmap(self, path: str) -> bool:
        """Block ``path`` unmapped in this process, or never mapped: False while a read
        holds it — mapped, or fetched and about to be (it is not evicted then)."""
        with self._lock:
            found = self._mapped_block(path)
            if found is None:
                return True
            mapping, index = found
            if mapping.held[index]:
                return False
            if mapping.present[index]:
                mapping.unmap(index)
            return True

    def _unmap_gone(self, listed: set[str]) -> None:
        """Unmap the blocks another process evicted (their disk space is held while
        mapped), unless a read holds them."""
        with self._lock:
            keys = [(key, m) for key, m in self._maps.items() if m is not None]
        for key, mapping in keys:
            for index in np.flatnonzero(mapping.present).tolist():
                path = f"{self._root}{os.sep}{key[:2]}{os.sep}{key}{os.sep}{index}"
                if path not in listed:
                    self._unmap(path)


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
