"""Where a corpus's files are: local paths, or URLs of object stores read through fsspec.

Every reader reaches its files through this module, so a manifest and its entries may
be local paths or URLs alike::

    --corpus s3://bucket/corpus/manifest.json      Url("s3://bucket/corpus/manifest.json")
    "shards": ["part-0"]                      ->   s3://bucket/corpus/part-0.tokens.npy
    "parquet": ["../other/x.parquet"]         ->   refused: outside s3://bucket/corpus/

A :class:`Url` is any fsspec protocol (``s3://``, ``gs://``, ``hf://``, ``http(s)://``,
...), its backend imported on first use (the ``remote``, ``gcs`` and ``hub`` extras).
A remote file (:class:`RemoteFile`) pins its size and ETag when the process first looks
it up (once: an open's checks and every reader share the lookup; a manifest is looked up
afresh); its bytes are read in fixed-size blocks through the node-local cache
(:mod:`.cache`), the missing blocks of one read fetched as few coalesced range requests,
at most ``max_requests`` at once, each retried with backoff and jitter on throttling,
5xx answers, dropped connections and timeouts, and never on 403/404
(:class:`~streampack.errors.CorpusUnavailable`, one line naming the URL). Credentials
come from the backends' own provider chains (environment, config files, instance
roles): a manifest cannot carry them, and no message names them.

Random-access readers address a remote array as :class:`RemoteArray` (slices, ``fetch``
of many ranges at once, and ``prefetch`` of the ranges the cut's next windows hold, in
the background); sequential readers a file object (:func:`open_binary`).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import io
import logging
import os
import posixpath
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, TypeVar

import numpy as np

from streampack.errors import CorpusUnavailable, InvalidConfig
from streampack.settings import StorageOptions

_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*)://")
T = TypeVar("T")


def is_url(text: str | os.PathLike[str]) -> bool:
    """Whether ``text`` names a store's object (``scheme://...``) rather than a path;
    ``file://`` is a local path."""
    found = _SCHEME.match(str(text))
    return found is not None and found.group(1).lower() != "file"


def redact(text: str) -> str:
    """``text`` with what may be a credential hidden: a URL's ``user:password@`` and
    signed-URL query values."""
    text = re.sub(r"(://)[^/@\s]+@", r"\1***@", text)
    return re.sub(
        r"([?&](?:X-Amz-[A-Za-z-]+|X-Goog-[A-Za-z-]+|Signature|sig|token|access_token|key)=)"
        r"[^&\s'\"]*",
        r"\1***",
        text,
        flags=re.IGNORECASE,
    )


# --- URLs ---------------------------------------------------------------------------------


class Url:
    """A file or folder of a store: ``scheme://path``, joined like a POSIX path (what
    the readers do with a ``Path``: ``/``, ``name``, ``parent``, ``with_name``)."""

    def __init__(self, text: str, options: StorageOptions | None = None) -> None:
        found = _SCHEME.match(text)
        if not found:
            raise InvalidConfig(f"{redact(text)!r} is not a URL (scheme://...)")
        self.scheme = found.group(1).lower()
        self.path = text[found.end() :]
        self.options = options or StorageOptions()

    def __str__(self) -> str:
        return redact(f"{self.scheme}://{self.path}")

    def __repr__(self) -> str:
        return f"Url({str(self)!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Url) and (self.scheme, self.path) == (other.scheme, other.path)

    def __hash__(self) -> int:
        return hash((self.scheme, self.path))

    def _with_path(self, path: str) -> Url:
        out = Url.__new__(Url)
        out.scheme, out.path, out.options = self.scheme, path, self.options
        return out

    def __truediv__(self, name: str) -> Url:
        return self._with_path(posixpath.join(self.path.rstrip("/"), name))

    @property
    def name(self) -> str:
        return posixpath.basename(self.path.rstrip("/"))

    @property
    def parent(self) -> Url:
        return self._with_path(posixpath.dirname(self.path.rstrip("/")))

    def with_name(self, name: str) -> Url:
        return self.parent / name

    def with_options(self, options: StorageOptions) -> Url:
        out = self._with_path(self.path)
        out.options = options
        return out

    @property
    def store(self) -> Store:
        return store_for(self.scheme, self.options)

    @property
    def address(self) -> str:
        """What the backend is given: the full URL (fsspec strips its protocol)."""
        return f"{self.scheme}://{self.path}"


CorpusPath = Path | Url


def as_location(text: str | Path | Url, options: StorageOptions | None = None) -> CorpusPath:
    """A path, or a :class:`Url` for a store's address (``file://`` is a path)."""
    if isinstance(text, Url):
        return text if options is None else text.with_options(options)
    if isinstance(text, Path):
        return text
    if text.lower().startswith("file://"):
        return Path(text[len("file://") :])
    return Url(text, options) if is_url(text) else Path(text)


def inside_url(root: Url, name: str, what: str, *, allow_outside: bool) -> Url:
    """``root / name``, refused when ``name`` is absolute, another URL, or leads out of
    ``root`` (``..``) unless ``allow_outside`` — the rule local names keep."""
    if is_url(name):
        if not allow_outside:
            raise InvalidConfig(
                f"{what} {redact(name)!r} is a URL; names in a manifest are relative to "
                f"the corpus folder {str(root)!r} (set corpus_allow_outside to allow this)"
            )
        return Url(name, root.options)
    if name.startswith("/"):
        if not allow_outside:
            raise InvalidConfig(
                f"{what} {name!r} is an absolute path; names in a manifest are relative to "
                f"the corpus folder {str(root)!r} (set corpus_allow_outside to allow this)"
            )
        return root._with_path(root.path.split("/", 1)[0] + name)  # the same bucket
    base = root.path.rstrip("/")
    joined = posixpath.normpath(posixpath.join(base, name))
    if not allow_outside and not (joined + "/").startswith(base + "/"):
        raise InvalidConfig(
            f"{what} {name!r} leads outside the corpus folder {str(root)!r}; names in a "
            f"manifest stay inside it (set corpus_allow_outside to allow this)"
        )
    return root._with_path(joined)


# --- Stores -------------------------------------------------------------------------------


@dataclasses.dataclass
class StoreCounters:
    """What one store did in this process, for ``health`` and ``/metrics``
    (:func:`storage_stats`). Counted here, below every reader, so any process that
    reads a corpus (the producer, a worker) has them."""

    requests: int = 0  # attempts (a retry is one more)
    bytes: int = 0  # fetched from the store
    retries: int = 0
    throttles: int = 0  # of the retries, those the store asked for (429, 503 SlowDown)
    cache_hits: int = 0  # blocks a read found in the node cache
    cache_misses: int = 0  # blocks a read had to fetch (or wait for another fetcher)
    cache_evictions: int = 0  # blocks this process removed to keep the cache bound
    prefetch_ahead_bytes: int = 0  # gauge: fetched ahead of the cursor, not read yet
    longest_wait: float = 0.0  # seconds one read waited for the store, at most


_STORES: dict[tuple[str, StorageOptions], Store] = {}
_STORES_LOCK = threading.Lock()


def store_for(scheme: str, options: StorageOptions) -> Store:
    """The one :class:`Store` of this process for ``scheme`` with ``options``."""
    key = (scheme, options)
    with _STORES_LOCK:
        if key not in _STORES:
            _STORES[key] = Store(scheme, options)
        return _STORES[key]


def stores() -> list[Store]:
    """Every store this process opened (its counters, for metrics)."""
    with _STORES_LOCK:
        return list(_STORES.values())


def storage_stats() -> dict[str, dict[str, float]]:
    """Every store's counters of this process, summed by scheme (``{"s3": {...}}``;
    ``longest_wait`` the longest of them): what ``health``'s ``storage`` and the
    ``streampack_storage_*`` metrics report. Local files are memory maps, not counted."""
    out: dict[str, dict[str, float]] = {}
    for store in stores():
        with store._lock:
            counted = dataclasses.asdict(store.counters)
        into = out.setdefault(store.scheme, dict.fromkeys(counted, 0))
        for name, value in counted.items():
            into[name] = max(into[name], value) if name == "longest_wait" else into[name] + value
    return out


def _backend_options(scheme: str, options: StorageOptions) -> dict[str, Any]:
    """What fsspec's backend for ``scheme`` takes for ``options``."""
    if scheme in ("s3", "s3a"):
        client: dict[str, Any] = {}
        if options.region:
            client["region_name"] = options.region
        return {
            "anon": options.anonymous,
            "endpoint_url": options.endpoint_url,
            "client_kwargs": client,
            # One attempt inside botocore: the retries (and their counting) are ours.
            # (Its ``max_attempts`` counts retries, not attempts: 1 was one more, unseen.)
            "config_kwargs": {
                "retries": {"total_max_attempts": 1, "mode": "standard"},
                "connect_timeout": 5,
                "read_timeout": 30,
                # A connection for each range request in flight (``max_requests``, and a
                # few single-block reads outside the pool): none waits for another's.
                "max_pool_connections": options.max_requests + 4,
            },
            "skip_instance_cache": True,
        }
    if scheme in ("gs", "gcs"):
        out: dict[str, Any] = {"skip_instance_cache": True}
        if options.anonymous:
            out["token"] = "anon"
        if options.endpoint_url:
            out["endpoint_url"] = options.endpoint_url
        return out
    if scheme == "hf":
        out = {"skip_instance_cache": True}
        if options.endpoint_url:
            out["endpoint"] = options.endpoint_url
        if options.anonymous:
            out["token"] = False
        return out
    return {"skip_instance_cache": True}


_EXTRAS = {"s3": "remote", "s3a": "remote", "gs": "gcs", "gcs": "gcs", "hf": "hub"}


def _filesystem(scheme: str, options: StorageOptions) -> Any:
    # The backends log where they found credentials and endpoints at INFO: not the
    # user's business on every start (and never the credentials themselves).
    for name in ("botocore", "aiobotocore", "s3fs", "fsspec", "gcsfs", "huggingface_hub"):
        logging.getLogger(name).setLevel(max(logging.WARNING, logging.getLogger(name).level))
    try:
        import fsspec
    except ImportError:
        raise InvalidConfig(
            f"reading {scheme}:// corpora needs fsspec; install it with: "
            f"pip install 'streampack[{_EXTRAS.get(scheme, 'remote')}]'"
        ) from None
    try:
        fs = fsspec.filesystem(scheme, **_backend_options(scheme, options))
    except ImportError as exc:
        raise InvalidConfig(
            f"reading {scheme}:// corpora needs its fsspec backend ({exc.name or exc}); "
            f"install it with: pip install 'streampack[{_EXTRAS.get(scheme, 'remote')}]'"
        ) from None
    except ValueError as exc:
        raise InvalidConfig(f"{scheme}:// is not a storage protocol fsspec knows: {exc}") from None
    if hasattr(fs, "retries"):  # s3fs retries inside each call too: ours count them
        fs.retries = 1
    return fs


def _status(exc: BaseException) -> int | None:
    """The HTTP status an exception carries, where it says one: its own, or the
    store's answer it was raised from (s3fs raises an ``OSError`` from botocore's
    error, which holds the answer). Not a cause's other numbers: aiohttp's error for
    a body cut short carries the code 400, which no store answered."""
    for name in ("status", "status_code", "code"):
        value = getattr(exc, name, None)
        if isinstance(value, int) and 100 <= value < 600:
            return value
    cause: BaseException | None = exc
    for _ in range(4):
        if cause is None:
            break
        response = getattr(cause, "response", None)
        if isinstance(response, dict):
            value = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            if isinstance(value, int):
                return value
        cause = cause.__cause__
    return None


def _permanent(exc: BaseException) -> bool:
    """Errors no retry mends: missing, denied, a bad request."""
    if isinstance(exc, (FileNotFoundError, PermissionError, IsADirectoryError, CorpusUnavailable)):
        return True
    if "pre-condition" in str(exc) or "PreconditionFailed" in str(exc):
        return True
    status = _status(exc)
    return status is not None and 400 <= status < 500 and status not in (408, 429)


def _throttled(exc: BaseException) -> bool:
    text = f"{type(exc).__name__} {exc}"
    return _status(exc) in (429, 503) or any(
        word in text for word in ("SlowDown", "Throttl", "TooManyRequests", "503")
    )


class Store:
    """One fsspec filesystem with its options: requests retried and counted, at most
    ``max_requests`` at once, blocks cached on the node (:mod:`.cache`)."""

    def __init__(self, scheme: str, options: StorageOptions) -> None:
        from streampack.corpus.cache import BlockCache

        self.scheme = scheme
        self.options = options
        self.fs = _filesystem(scheme, options)
        self.counters = StoreCounters()
        self._lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(
            options.max_requests, thread_name_prefix=f"streampack-{scheme}"
        )
        self.cache = BlockCache(options.cache_dir, options.cache_bytes, self.counters)
        self._infos: dict[Url, dict[str, Any]] = {}

    @property
    def prefetch_budget(self) -> int:
        """Bytes a reader may have fetched ahead of its cursor: ``prefetch_bytes``, and
        never more than half the cache (what is fetched ahead must still be there when
        the cursor comes to it)."""
        return min(self.options.prefetch_bytes, self.cache.limit // 2)

    def count(self, **added: float) -> None:
        with self._lock:
            for name, value in added.items():
                setattr(self.counters, name, getattr(self.counters, name) + value)

    def call(self, url: Url, what: str, action: Callable[[], T]) -> T:
        """``action()`` retried with exponential backoff and full jitter while it fails
        in a way a retry may mend; a permanent failure, or the last, is one line."""
        delay = 0.05
        for attempt in range(1, self.options.retries + 1):
            try:
                self.count(requests=1)
                return action()
            except Exception as exc:
                if _permanent(exc) or attempt == self.options.retries:
                    raise _unavailable(url, what, exc, attempt) from None
                self.count(retries=1, throttles=int(_throttled(exc)))
                time.sleep(random.uniform(0, delay))
                delay = min(delay * 2, 4.0)
        raise AssertionError("unreachable")

    def info(self, url: Url, fresh: bool = False) -> dict[str, Any]:
        """The object's size, ETag, ... looked up once per process (``fresh``: again):
        every reader of a file in this process then reads the version pinned then, and
        opening a corpus costs one request per file, not one per check."""
        if not fresh:
            with self._lock:
                known = self._infos.get(url)
            if known is not None:
                return known
        found = self.call(url, "look up", lambda: self.fs.info(url.address))
        with self._lock:
            self._infos[url] = found
        return found

    def exists(self, url: Url) -> bool:
        try:
            self.info(url)
        except CorpusUnavailable as exc:
            if exc.missing:
                return False
            raise
        return True

    def fetch(self, file: RemoteFile, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` of ``file`` in one range request (retried), of the
        version pinned when it was opened: S3 asks for it (``If-Match``), every store's
        answer is checked against the pinned size."""
        if self.scheme in ("s3", "s3a") and file.etag:
            data = self.call(file.url, "read", lambda: self._s3_get(file, start, stop))
        else:
            data = self.call(
                file.url,
                "read",
                lambda: bytes(self.fs.cat_file(file.url.address, start=start, end=stop)),
            )
        if len(data) != stop - start:
            raise file.changed(f"a read of bytes {start}..{stop} answered {len(data)}")
        self.count(bytes=len(data))
        return data

    def _s3_get(self, file: RemoteFile, start: int, stop: int) -> bytes:
        from fsspec.asyn import sync

        bucket, key, _ = self.fs.split_path(file.url.address)

        async def get() -> bytes:
            answer = await self.fs._call_s3(
                "get_object",
                Bucket=bucket,
                Key=key,
                Range=f"bytes={start}-{stop - 1}",
                IfMatch=f'"{file.etag}"',
            )
            try:
                return bytes(await answer["Body"].read())
            finally:
                answer["Body"].close()

        try:
            return sync(self.fs.loop, get)
        except OSError as exc:
            if "pre-condition" in str(exc) or "PreconditionFailed" in str(exc):
                raise file.changed("the store holds another version (If-Match failed)") from None
            raise

    def map(self, jobs: list[Callable[[], T]]) -> list[T]:
        """``jobs`` run at most ``max_requests`` at once; results in order."""
        if len(jobs) == 1:
            return [jobs[0]()]
        return list(self._pool.map(lambda job: job(), jobs))


def _unavailable(url: Url, what: str, exc: BaseException, attempts: int) -> CorpusUnavailable:
    status = _status(exc)
    if isinstance(exc, CorpusUnavailable):
        return exc
    if isinstance(exc, FileNotFoundError) or status == 404:
        return CorpusUnavailable(f"corpus file {str(url)!r} does not exist", missing=True)
    if isinstance(exc, PermissionError) or status in (401, 403):
        return CorpusUnavailable(
            f"access to corpus file {str(url)!r} is denied ({status or 403}); check the "
            f"credentials the store's provider chain gives (environment, config files, "
            f"instance role), or set corpus_anonymous for a public bucket"
        )
    detail = redact(f"{type(exc).__name__}: {exc}".splitlines()[0])[:300]
    return CorpusUnavailable(
        f"cannot {what} corpus file {str(url)!r} after {attempts} attempt(s): {detail}"
    )


# --- Remote files -------------------------------------------------------------------------


def _etag(info: Mapping[str, Any]) -> str:
    for key in ("ETag", "etag", "generation", "blob_id", "md5Hash", "mtime", "LastModified"):
        if info.get(key) is not None:
            return str(info[key]).strip('"')
    return ""


class RemoteFile:
    """One object of a store, its size and ETag pinned when opened: every block read
    is of that version (a changed object is refused, never mixed in)."""

    def __init__(self, url: Url, what: str = "corpus file", fresh: bool = False) -> None:
        self.url = url
        self.store = url.store
        info = self.store.info(url, fresh)
        if info.get("type") == "directory":
            raise InvalidConfig(f"{what} {str(url)!r} is a folder; expected a file")
        self.size = int(info.get("size") or 0)
        self.etag = _etag(info)
        self.block = self.store.options.block_bytes
        self.key = hashlib.sha256(f"{url.address}\0{self.etag}\0{self.size}".encode()).hexdigest()
        self.name = url.name

    def __str__(self) -> str:
        return str(self.url)

    def changed(self, how: str) -> CorpusUnavailable:
        """The error for an object that changed after it was opened: never mixed in."""
        return CorpusUnavailable(
            f"corpus file {str(self.url)!r} changed while it was read ({how}; opened at "
            f"{self.size} bytes, ETag {self.etag!r}); a corpus must not change under a "
            f"run: write a new corpus (or manifest) instead and restart on it"
        )

    def _block_range(self, index: int) -> tuple[int, int]:
        return index * self.block, min(self.size, (index + 1) * self.block)

    def blocks(self, indices: np.ndarray, ahead: bool = False) -> dict[int, np.ndarray]:
        """Blocks ``indices`` (sorted, distinct) of the file (uint8 arrays): from the
        node cache, the missing ones fetched in runs of consecutive blocks, in parallel
        (``ahead``: for a later read)."""
        return self.store.cache.blocks(self, [int(i) for i in indices], ahead)

    def fetch_run(self, first: int, count: int) -> list[memoryview]:
        """Blocks ``first .. first + count - 1`` in one range request, split (views of
        the one answer, not copies)."""
        start = first * self.block
        stop = min(self.size, (first + count) * self.block)
        began = time.monotonic()
        data = memoryview(self.store.fetch(self, start, stop))
        waited = time.monotonic() - began
        with self.store._lock:
            self.store.counters.longest_wait = max(self.store.counters.longest_wait, waited)
        return [data[k * self.block : (k + 1) * self.block] for k in range(count)]

    def read(self, start: int, stop: int) -> bytes:
        """Bytes ``[start, stop)`` (clipped to the file)."""
        stop = min(stop, self.size)
        if stop <= start:
            return b""
        first, last = start // self.block, (stop - 1) // self.block
        got = self.blocks(np.arange(first, last + 1))
        joined = b"".join(got[i].data for i in range(first, last + 1))  # no kernel: a manifest
        return joined[start - first * self.block : stop - first * self.block]

    def _pieces(
        self, starts: np.ndarray, stops: np.ndarray, at: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """The ranges ``[starts[i], stops[i])`` (non-empty) cut at block boundaries:
        each piece's block, its start in the block, its length and where it goes
        (``at[i]`` is where range i goes), ordered by block."""
        first, last = starts // self.block, (stops - 1) // self.block
        spans = last - first + 1
        owner = np.repeat(np.arange(len(starts)), spans)
        block = first[owner] + np.arange(len(owner)) - np.repeat(np.cumsum(spans) - spans, spans)
        lo = np.maximum(starts[owner], block * self.block)
        hi = np.minimum(stops[owner], (block + 1) * self.block)
        order = np.argsort(block, kind="stable")
        block, lo, hi, owner = block[order], lo[order], hi[order], owner[order]
        return block, lo - block * self.block, hi - lo, at[owner] + lo - starts[owner]

    def ranges(self, starts: np.ndarray, stops: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The byte ranges ``[starts[i], stops[i])`` concatenated (uint8), and where
        each starts in it: every block they touch read once (fetched or mapped from
        the cache), its pieces copied out in one compiled call per block."""
        from streampack.kernels.corpus_cpu import copy_ranges

        starts = np.asarray(starts, np.int64)
        stops = np.asarray(stops, np.int64)
        sizes = stops - starts
        out_starts = np.cumsum(sizes) - sizes
        out = np.empty(int(sizes.sum()), np.uint8)
        live = sizes > 0
        if not live.any():
            return out, out_starts
        block, lo, length, to = self._pieces(starts[live], stops[live], out_starts[live])
        bounds = np.flatnonzero(np.diff(block)) + 1
        needed = block[np.concatenate([[0], bounds])]
        got = self.blocks(needed)
        for b, (p, q) in zip(
            needed.tolist(),
            zip(np.concatenate([[0], bounds]).tolist(), np.append(bounds, len(block)).tolist()),
            strict=True,
        ):
            copy_ranges(got[b], lo[p:q], length[p:q], out, to[p:q])
        return out, out_starts

    def _touched(self, starts: np.ndarray, stops: np.ndarray) -> np.ndarray:
        """The blocks the byte ranges ``[starts[i], stops[i])`` touch, sorted, once each."""
        starts = np.asarray(starts, np.int64)
        stops = np.minimum(np.asarray(stops, np.int64), self.size)
        live = stops > starts
        first, last = starts[live] // self.block, (stops[live] - 1) // self.block
        spans = last - first + 1
        return np.unique(
            np.repeat(first - np.cumsum(spans) + spans, spans) + np.arange(int(spans.sum()))
        )

    @contextlib.contextmanager
    def mapped(self, starts: np.ndarray, stops: np.ndarray) -> Iterator[np.ndarray | None]:
        """The whole file as one uint8 array, readable in the byte ranges while the
        ``with`` lasts (``cache.BlockCache.mapped``: a local read for blocks cached
        before), or None where the cache does not map them so."""
        with self.store.cache.mapped(self, self._touched(starts, stops)) as whole:
            yield whole

    def prefetch(self, starts: np.ndarray, stops: np.ndarray) -> int:
        """Fetch the blocks the byte ranges touch in the background, for a later read
        (the windows the cut will produce next); the bytes of those blocks."""
        needed = self._touched(starts, stops)
        if not len(needed):
            return 0
        self.store.cache.plan(self, needed.tolist())
        _PREFETCH.submit(self._ahead, needed)
        return len(needed) * self.block

    def _ahead(self, needed: np.ndarray) -> None:
        try:
            self.blocks(needed, ahead=True)
        except Exception:  # noqa: BLE001 - the foreground read fetches it again, and says why
            logging.getLogger(__name__).debug("prefetch of %s failed", self, exc_info=True)


class RemoteArray:
    """A 1-D array of ``dtype`` stored in a remote file from byte ``offset``: sliced
    like a memory map (each slice read through the cache), and ``fetch`` of many
    ranges at once (``corpus.gather`` uses it for a window's documents)."""

    def __init__(self, file: RemoteFile, offset: int, dtype: Any, length: int) -> None:
        self.file = file
        self.offset = offset
        self.dtype = np.dtype(dtype)
        self.length = length
        self.shape: tuple[int, ...] = (length,)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: Any) -> Any:
        size = self.dtype.itemsize
        if isinstance(key, slice):
            lo, hi, step = key.indices(self.length)
            if step != 1:
                return self[lo:hi][::step]
            hi = max(hi, lo)
            with self.view(np.array([lo]), np.array([hi - lo])) as whole:
                if whole is not None:  # copied: the blocks may be unmapped after the with
                    return whole[lo:hi].copy()
            data = self.file.read(self.offset + lo * size, self.offset + hi * size)
            return np.frombuffer(data, self.dtype)
        if np.ndim(key) == 0:
            at = int(key)
            if at < 0:
                at += self.length
            if not 0 <= at < self.length:
                raise IndexError(f"index {int(key)} out of range for {self.length}")
            return self[at : at + 1][0]
        index = np.asarray(key, np.int64)
        flat = index.ravel()
        values = self.fetch(flat, np.ones(len(flat), np.int64))
        return values.reshape(index.shape)

    @contextlib.contextmanager
    def view(self, starts: np.ndarray, lengths: np.ndarray) -> Iterator[np.ndarray | None]:
        """The whole array, as a local memory map is, its elements ``[starts[i],
        starts[i] + lengths[i])`` readable while the ``with`` lasts (``RemoteFile.mapped``);
        None where the cache does not map them so (``fetch`` reads them then)."""
        size = self.dtype.itemsize
        lo = self.offset + np.asarray(starts, np.int64) * size
        with self.file.mapped(lo, lo + np.asarray(lengths, np.int64) * size) as whole:
            if whole is None:
                yield None
            else:
                yield whole[self.offset : self.offset + self.length * size].view(self.dtype)

    def prefetch(self, starts: np.ndarray, lengths: np.ndarray) -> int:
        """Elements ``[starts[i], starts[i] + lengths[i])`` fetched in the background
        for a later ``fetch`` (``RemoteFile.prefetch``); the bytes of their blocks."""
        size = self.dtype.itemsize
        lo = self.offset + np.asarray(starts, np.int64) * size
        return self.file.prefetch(lo, lo + np.asarray(lengths, np.int64) * size)

    def fetch(self, starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """Elements ``[starts[i], starts[i] + lengths[i])`` for each i, concatenated."""
        size = self.dtype.itemsize
        lo = self.offset + np.asarray(starts, np.int64) * size
        data, _ = self.file.ranges(lo, lo + np.asarray(lengths, np.int64) * size)
        return data.view(self.dtype)


# --- One interface for both -----------------------------------------------------------------


def remote(path: CorpusPath, what: str) -> RemoteFile | None:
    """The remote file at ``path`` (its size and ETag pinned), or None for a local path."""
    return RemoteFile(path, what) if isinstance(path, Url) else None


def index_path(path: CorpusPath, what: str, kind: str) -> Path | None:
    """Where a reader keeps what a whole pass of a remote file taught it (a JSON Lines
    line index, a Parquet file's document lengths): ``DIR/index/KEY.KIND.npy`` beside
    the node cache's blocks, named by the object's version (URL, ETag, size) and never
    evicted with them; None for a local path."""
    if not isinstance(path, Url):
        return None
    file = RemoteFile(path, what)
    return file.store.cache.root / "index" / f"{file.key}.{kind}.npy"


def save_index(where: Path, index: np.ndarray) -> None:
    """``index`` written to ``where`` atomically (a reader sees all of it or none)."""
    where.parent.mkdir(parents=True, exist_ok=True)
    temporary = where.with_name(f".{where.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    with open(temporary, "wb") as handle:
        np.save(handle, index, allow_pickle=False)
    os.replace(temporary, where)


def load_index(where: Path | None) -> np.ndarray | None:
    """The array ``save_index`` wrote at ``where``; None when there is none (or it
    cannot be read)."""
    if where is None:
        return None
    try:
        return np.load(where, allow_pickle=False)
    except (OSError, ValueError):
        return None


def exists(path: CorpusPath) -> bool:
    return path.store.exists(path) if isinstance(path, Url) else path.exists()


def read_bytes(path: CorpusPath, what: str) -> bytes:
    """The whole file (a manifest, an index, a state file)."""
    if isinstance(path, Url):
        file = RemoteFile(path, what, fresh=True)  # a manifest: as it is now
        return file.read(0, file.size)
    return path.read_bytes()


class _RangedReader(io.RawIOBase):
    """A remote file as a seekable binary file: reads go through its blocks (and so
    the cache); a sequential reader gets the next ``prefetch_bytes`` fetched ahead."""

    def __init__(self, file: RemoteFile) -> None:
        self.file = file
        self.pos = 0
        self._ahead: concurrent.futures.Future[Any] | None = None

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self.pos, io.SEEK_END: self.file.size}[whence]
        self.pos = max(0, base + offset)
        return self.pos

    def tell(self) -> int:
        return self.pos

    def size(self) -> int:
        return self.file.size

    def readinto(self, buffer: Any) -> int:
        view = memoryview(buffer).cast("B")
        data = self.file.read(self.pos, self.pos + len(view))
        view[: len(data)] = data
        self.pos += len(data)
        self._prefetch()
        return len(data)

    def _prefetch(self) -> None:
        """Fetch the blocks after the cursor (up to ``prefetch_bytes``) in the
        background, one batch at a time: the next read then finds them cached."""
        budget = self.file.store.prefetch_budget
        if budget <= 0 or (self._ahead is not None and not self._ahead.done()):
            return
        block = self.file.block
        first = self.pos // block + 1
        last = min((self.pos + budget) // block, (self.file.size - 1) // block)
        if last < first:
            return
        indices = np.arange(first, last + 1)
        self._ahead = _PREFETCH.submit(self.file.blocks, indices, True)


_PREFETCH = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="streampack-prefetch")


def open_binary(path: CorpusPath, what: str = "corpus file") -> io.BufferedReader:
    """``path`` opened for reading bytes, local or remote alike."""
    if isinstance(path, Url):
        file = RemoteFile(path, what)
        return io.BufferedReader(_RangedReader(file), buffer_size=min(file.block, 1 << 20))
    return open(path, "rb")


def file_size(path: CorpusPath, what: str = "corpus file") -> int:
    return RemoteFile(path, what).size if isinstance(path, Url) else path.stat().st_size
