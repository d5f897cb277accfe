"""Service settings: one frozen, keyword-only dataclass per process role.

Every setting has a default that works on one machine, is checked once in
``__post_init__`` (the message names the field, its value and what is accepted), and
can come from three places, last one wins::

    defaults  <  TOML file (``--config``, one table per role)  <  command-line flags

The TOML file has one optional table per role; unknown keys are an error so that a
typo never silently falls back to a default::

    [producer]
    corpus = "fixtures/corpus"
    capacity = 256
    epochs = 2

    [worker]
    audit_every = 0

    [consumer]
    prefetch = 4

``docs/service.md`` lists every setting with its default; ``FIELD_HELP`` below is the
single source of those descriptions (the CLI flags reuse it; ``"role.field"`` keys
where the roles' units differ).
"""

from __future__ import annotations

import argparse
import dataclasses
import ipaddress
import os
import re
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypeVar

from streampack.config import POLICIES, PackConfig
from streampack.errors import InvalidConfig

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

_MIB = 1 << 20

TAIL_MODES = ("fill", "drop")
_ENDPOINT_FORMS = "tcp://HOST:PORT (PORT 1-65535 or *), ipc://PATH or inproc://NAME"
#: Who sends batches to consumers (``ProducerSettings.data_plane``).
DATA_PLANES = ("producer", "workers")
_HOST_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")


def _endpoint_problem(value: str) -> str:
    """Why ``value`` is not an endpoint ZeroMQ can bind or connect, or "" when it is."""
    scheme, separator, address = value.partition("://")
    if not separator or scheme not in ("tcp", "ipc", "inproc"):
        return "it has no tcp://, ipc:// or inproc:// scheme"
    if scheme != "tcp":
        return "" if address else f"the {scheme}:// address is empty"
    host, colon, port = address.rpartition(":")
    if not colon:
        return "it has no :PORT"
    if port != "*" and not (port.isdigit() and 1 <= int(port) <= 65535):
        return f"port {port!r} is not a number in 1-65535 or *"
    kind: type[ipaddress.IPv4Address | ipaddress.IPv6Address]
    if host.startswith("[") and host.endswith("]"):
        address_text, kind = host[1:-1], ipaddress.IPv6Address
    elif host and all(c.isdigit() or c == "." for c in host):
        address_text, kind = host, ipaddress.IPv4Address
    elif host == "*" or _HOST_NAME.fullmatch(host):
        return ""
    else:
        return f"host {host!r} is not an IP address, a host name or *"
    try:
        kind(address_text)
    except ValueError:
        return f"host {host!r} is not a valid IP address"
    return ""


def check_endpoint(field: str, value: Any) -> None:
    """Refuse ``value`` unless ZeroMQ can bind or connect it (checked before any socket)."""
    problem = _endpoint_problem(value) if isinstance(value, str) else "it is not a string"
    if problem:
        raise InvalidConfig(
            f"{field} = {value!r} is not a ZeroMQ endpoint ({problem}); expected {_ENDPOINT_FORMS}"
        )


def z85_key_problem(key: str | bytes) -> str:
    """Why ``key`` is not a 40-character Z85 CURVE key, or "" when it is one."""
    from zmq.utils import z85

    text = key.decode("ascii", "replace") if isinstance(key, bytes) else key
    if len(text) != 40:
        return f"it has {len(text)} characters, not 40"
    try:
        z85.decode(text)
    except (KeyError, ValueError, struct.error):  # a character outside Z85, or overflow
        return "it is not Z85 text (ZeroMQ's printable key encoding)"
    return ""


def check_curve_key(field: str, value: Any) -> None:
    """Refuse a CURVE public key that ZeroMQ would reject (``None``: no CURVE)."""
    if value is None:
        return
    problem = z85_key_problem(value) if isinstance(value, str) else "it is not a string"
    if problem:
        raise InvalidConfig(
            f"{field} = {value!r} is not a CURVE public key ({problem}); expected the 40 Z85 "
            f"characters of the producer's public key (see docs/service.md, Security)"
        )


def check_rank(rank: Any, world_size: Any) -> None:
    """Refuse a (rank, world size) pair that names no rank of a job."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise InvalidConfig(f"world_size = {world_size!r} must be an integer >= 1")
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
        raise InvalidConfig(
            f"rank = {rank!r} is not a rank of world_size {world_size}; "
            f"expected an integer in 0..{world_size - 1}"
        )


def check_output_path(field: str, path: str) -> None:
    """Refuse, at startup, a file path that could not be written later: its directory must
    exist and be writable (and the path, when it exists, must be a writable file)."""
    target = Path(path)
    folder = target.parent
    if not folder.is_dir():
        raise InvalidConfig(
            f"{field} = {path!r}: directory {str(folder)!r} does not exist; "
            f"expected a file path in an existing, writable directory"
        )
    if target.is_dir() or not os.access(target if target.exists() else folder, os.W_OK):
        raise InvalidConfig(
            f"{field} = {path!r} is not writable; expected a file path in an "
            f"existing, writable directory"
        )


def check_number(
    field: str, value: Any, *, minimum: float, integer: bool = False, inclusive: bool = True
) -> None:
    """Refuse ``value`` unless it is a number (an integer with ``integer``) at least
    ``minimum`` (above it when not ``inclusive``); NaN is refused too."""
    kind, types = ("an integer", int) if integer else ("a number", (int, float))
    bound = ">=" if inclusive else ">"
    if (
        isinstance(value, bool)
        or not isinstance(value, types)
        or not (value >= minimum if inclusive else value > minimum)
    ):
        raise InvalidConfig(f"{field} = {value!r} must be {kind} {bound} {minimum}")


def _check_int(field: str, value: Any, *, minimum: int) -> None:
    check_number(field, value, minimum=minimum, integer=True)


def _check_metrics(port: Any, address: Any) -> None:
    if port is not None and (
        isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535
    ):
        raise InvalidConfig(
            f"metrics_port = {port!r} must be a TCP port in 0..65535 "
            f"(0: any free port), or unset to serve no metrics"
        )
    if not isinstance(address, str) or not address:
        raise InvalidConfig(
            f"metrics_address = {address!r} must be an IP address or host "
            f"name, e.g. 127.0.0.1 or 0.0.0.0"
        )


def _check_float(field: str, value: Any, *, minimum: float) -> None:
    check_number(field, value, minimum=minimum, inclusive=False)


#: Storage options a manifest's ``"storage"`` object (or the settings) may give; never
#: a credential: those come from the backends' provider chains.
MANIFEST_OPTIONS = ("endpoint_url", "region", "anonymous")
_CREDENTIAL_WORDS = ("key", "secret", "token", "password", "credential", "session")


@dataclasses.dataclass(frozen=True, kw_only=True)
class StorageOptions:
    """How remote corpus files are reached and cached (``ProducerSettings``'
    ``corpus_*`` fields, with a manifest's ``"storage"`` object on top of the first
    three; read by ``corpus/storage.py``)."""

    endpoint_url: str | None = None  # an S3-compatible store, a private hub, ...
    region: str | None = None
    anonymous: bool = False  # unsigned requests (public buckets)
    cache_dir: str | None = None  # None: a temporary directory of this process
    cache_bytes: int = 8 << 30
    block_bytes: int = 4 * _MIB
    max_requests: int = 8  # range requests in flight at once, per store
    retries: int = 8  # attempts of one request before it is given up
    prefetch_bytes: int = 64 * _MIB  # fetched ahead of the cursor (the next windows' blocks)

    def __post_init__(self) -> None:
        for name in ("cache_bytes", "block_bytes", "max_requests", "retries"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidConfig(f"corpus_{name} = {value!r} must be a positive integer")
        if isinstance(self.prefetch_bytes, bool) or not isinstance(self.prefetch_bytes, int):
            raise InvalidConfig(f"corpus_prefetch_bytes = {self.prefetch_bytes!r} must be >= 0")
        if self.prefetch_bytes < 0:
            raise InvalidConfig(f"corpus_prefetch_bytes = {self.prefetch_bytes!r} must be >= 0")
        if not isinstance(self.anonymous, bool):
            raise InvalidConfig(f"corpus_anonymous = {self.anonymous!r} must be true or false")
        for name in ("endpoint_url", "region", "cache_dir"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise InvalidConfig(f"corpus_{name} = {value!r} must be a non-empty string")

    def with_manifest(self, storage: Any, where: str) -> StorageOptions:
        """These options with a manifest's ``"storage"`` object on top (checked)."""
        if storage is None:
            return self
        if not isinstance(storage, Mapping):
            raise InvalidConfig(
                f"{where}: storage {storage!r} must be an object of {', '.join(MANIFEST_OPTIONS)}"
            )
        for key in storage:
            if any(word in str(key).lower() for word in _CREDENTIAL_WORDS):
                raise InvalidConfig(
                    f"{where}: storage option {key!r} looks like a credential; a manifest "
                    f"never carries credentials (they come from the store's own provider "
                    f"chain: environment variables, config files, instance roles)"
                )
            if key not in MANIFEST_OPTIONS:
                raise InvalidConfig(
                    f"{where}: unknown storage option {key!r}; accepted: "
                    f"{', '.join(MANIFEST_OPTIONS)}"
                )
        return dataclasses.replace(self, **dict(storage))


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProducerSettings:
    """What the producer reads, how it cuts and packs, and how much it may hold."""

    corpus: str | None = None
    corpus_allow_outside: bool = False
    # A remote corpus (a URL): how its store is reached and its files cached on the
    # node (StorageOptions; None: its default).
    corpus_endpoint_url: str | None = None
    corpus_region: str | None = None
    corpus_anonymous: bool = False
    corpus_cache_dir: str | None = None
    corpus_cache_bytes: int | None = None
    corpus_block_bytes: int | None = None
    corpus_max_requests: int | None = None
    corpus_retries: int | None = None
    corpus_prefetch_bytes: int | None = None
    worker_endpoint: str = "tcp://127.0.0.1:5555"
    consumer_endpoint: str = "tcp://127.0.0.1:5556"
    capacity: int = 2048
    max_rows_per_batch: int = 8
    max_cells: int | None = None
    max_metadata_bytes: int = 256 * _MIB
    policy: str = "next_fit"
    open_rows: int | None = None
    window_documents: int = 1024
    window_tokens: int = 1 << 18
    epochs: int = 1
    shuffle: bool = False
    seed: int = 0
    shuffle_buffer: int = 4096
    tail: str = "fill"
    accumulation: int = 1
    window_budget_bytes: int = 64 * _MIB
    reorder_budget_bytes: int = 256 * _MIB
    max_message_bytes: int = 256 * _MIB
    heartbeat_timeout: float = 5.0
    window_timeout: float = 60.0
    backups: bool = True
    backup_after: float = 1.0
    consumer_timeout: float = 60.0
    data_plane: str = "producer"
    quarantine_path: str | None = None
    curve_secret_key_file: str | None = None
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"

    def corpus_path(self) -> str:
        """``corpus``, which every command that reads the corpus needs."""
        if self.corpus is None:
            raise InvalidConfig(
                "corpus is not set; pass --corpus PATH or set corpus in the [producer] table"
            )
        return self.corpus

    def storage(self) -> StorageOptions:
        """How a remote corpus is reached and cached: the ``corpus_*`` fields given."""
        given = {
            f.name: getattr(self, f"corpus_{f.name}")
            for f in dataclasses.fields(StorageOptions)
            if getattr(self, f"corpus_{f.name}") is not None
        }
        return StorageOptions(**given)

    def pack_config(self) -> PackConfig:
        """The ``PackConfig`` every window is packed with (and a worker's plan checked
        against)."""
        return PackConfig(
            capacity=self.capacity,
            max_rows_per_batch=self.max_rows_per_batch,
            max_cells=self.max_cells,
            max_metadata_bytes=self.max_metadata_bytes,
            policy=self.policy,
            open_rows=self.open_rows,
        )

    def __post_init__(self) -> None:
        _check_metrics(self.metrics_port, self.metrics_address)
        if self.corpus is not None and not isinstance(self.corpus, str):
            raise InvalidConfig(f"corpus = {self.corpus!r} must be a path string")
        if not isinstance(self.corpus_allow_outside, bool):
            raise InvalidConfig(
                f"corpus_allow_outside = {self.corpus_allow_outside!r} must be true or false"
            )
        self.storage()  # the corpus_* storage fields, checked together
        check_endpoint("worker_endpoint", self.worker_endpoint)
        check_endpoint("consumer_endpoint", self.consumer_endpoint)
        _check_int("capacity", self.capacity, minimum=1)
        _check_int("max_rows_per_batch", self.max_rows_per_batch, minimum=1)
        if self.max_cells is not None:
            _check_int("max_cells", self.max_cells, minimum=self.capacity)
        _check_int("max_metadata_bytes", self.max_metadata_bytes, minimum=1)
        _check_int("window_documents", self.window_documents, minimum=1)
        _check_int("window_tokens", self.window_tokens, minimum=self.capacity + 1)
        _check_int("epochs", self.epochs, minimum=0)
        if not isinstance(self.shuffle, bool):
            raise InvalidConfig(f"shuffle = {self.shuffle!r} must be true or false")
        _check_int("seed", self.seed, minimum=0)
        _check_int("shuffle_buffer", self.shuffle_buffer, minimum=1)
        if self.tail not in TAIL_MODES:
            raise InvalidConfig(f"tail = {self.tail!r}; expected one of {', '.join(TAIL_MODES)}")
        _check_int("accumulation", self.accumulation, minimum=1)
        _check_int("window_budget_bytes", self.window_budget_bytes, minimum=1)
        _check_int("reorder_budget_bytes", self.reorder_budget_bytes, minimum=1)
        _check_int("max_message_bytes", self.max_message_bytes, minimum=4096)
        _check_float("heartbeat_timeout", self.heartbeat_timeout, minimum=0.0)
        _check_float("window_timeout", self.window_timeout, minimum=0.0)
        if not isinstance(self.backups, bool):
            raise InvalidConfig(f"backups = {self.backups!r} must be true or false")
        _check_float("backup_after", self.backup_after, minimum=0.0)
        _check_float("consumer_timeout", self.consumer_timeout, minimum=0.0)
        if self.data_plane not in DATA_PLANES:
            raise InvalidConfig(
                f"data_plane = {self.data_plane!r}; expected one of {', '.join(DATA_PLANES)}"
            )
        if self.quarantine_path is not None and not isinstance(self.quarantine_path, str):
            raise InvalidConfig(f"quarantine_path = {self.quarantine_path!r} must be a path")
        if self.policy not in POLICIES:
            raise InvalidConfig(f"policy = {self.policy!r}; expected one of {', '.join(POLICIES)}")
        if self.open_rows is not None:
            _check_int("open_rows", self.open_rows, minimum=1)
        self.pack_config()  # the packing fields together: open_rows against the policy


@dataclasses.dataclass(frozen=True, kw_only=True)
class WorkerSettings:
    """How a pack worker reaches its producer and how often it audits."""

    connect: str = "tcp://127.0.0.1:5555"
    prefetch: int = 2
    heartbeat_interval: float = 0.5
    audit_every: int = 0
    max_message_bytes: int = 256 * _MIB
    curve_server_key: str | None = None
    metrics_port: int | None = None
    metrics_address: str = "127.0.0.1"
    serve_endpoint: str | None = None
    serve_advertise: str | None = None
    store_bytes: int = 256 * _MIB
    store_seconds: float = 60.0

    def __post_init__(self) -> None:
        _check_metrics(self.metrics_port, self.metrics_address)
        check_endpoint("connect", self.connect)
        for field in ("serve_endpoint", "serve_advertise"):
            if getattr(self, field) is not None:
                check_endpoint(field, getattr(self, field))
        if self.serve_advertise is not None and self.serve_endpoint is None:
            raise InvalidConfig(
                f"serve_advertise = {self.serve_advertise!r} needs serve_endpoint: a worker "
                "advertises the endpoint it serves consumers on; set serve_endpoint too"
            )
        _check_int("store_bytes", self.store_bytes, minimum=1)
        _check_float("store_seconds", self.store_seconds, minimum=0.0)
        check_curve_key("curve_server_key", self.curve_server_key)
        _check_int("prefetch", self.prefetch, minimum=1)
        _check_float("heartbeat_interval", self.heartbeat_interval, minimum=0.0)
        _check_int("audit_every", self.audit_every, minimum=0)
        _check_int("max_message_bytes", self.max_message_bytes, minimum=4096)


@dataclasses.dataclass(frozen=True, kw_only=True)
class ConsumerSettings:
    """How a trainer-side client fetches batches."""

    connect: str = "tcp://127.0.0.1:5556"
    prefetch: int = 4
    prefetch_bytes: int = 256 * _MIB
    timeout: float = 60.0
    max_message_bytes: int = 256 * _MIB
    curve_server_key: str | None = None
    route_timeout: float = 2.0

    def __post_init__(self) -> None:
        check_endpoint("connect", self.connect)
        check_curve_key("curve_server_key", self.curve_server_key)
        _check_int("prefetch", self.prefetch, minimum=1)
        _check_int("prefetch_bytes", self.prefetch_bytes, minimum=1)
        _check_float("timeout", self.timeout, minimum=0.0)
        _check_float("route_timeout", self.route_timeout, minimum=0.0)
        _check_int("max_message_bytes", self.max_message_bytes, minimum=4096)


FIELD_HELP: dict[str, str] = {
    "corpus": "corpus manifest (JSON) or a directory holding manifest.json",
    "corpus_allow_outside": "let file names in the corpus manifest be absolute or lead "
    "outside its directory",
    "corpus_endpoint_url": "a remote corpus's store endpoint (an S3-compatible store, a "
    "private hub); default: the backend's own (AWS_ENDPOINT_URL for S3)",
    "corpus_region": "a remote corpus's store region",
    "corpus_anonymous": "read a remote corpus unsigned (a public bucket)",
    "corpus_cache_dir": "node-local cache of remote corpus blocks, shared by the processes "
    "that name it (default: a temporary directory per process)",
    "corpus_cache_bytes": "the cache's size limit (default 8 GiB)",
    "corpus_block_bytes": "bytes per cached block and per smallest range request (default 4 MiB)",
    "corpus_max_requests": "range requests in flight at once per store (default 8)",
    "corpus_retries": "attempts of one request on throttling, 5xx or timeouts (default 8)",
    "corpus_prefetch_bytes": "bytes fetched ahead of the cursor: the next windows' blocks, or a "
    "sequential reader's next bytes (default 64 MiB)",
    "worker_endpoint": "where the producer binds for pack workers (use tcp://0.0.0.0:PORT "
    "to accept remote workers)",
    "consumer_endpoint": "where the producer binds for consumers and health checks",
    "capacity": "prediction pairs per row",
    "max_rows_per_batch": "rows per batch (the last batch of a window may have fewer)",
    "max_cells": "upper bound on rows*capacity per batch (default: no bound)",
    "max_metadata_bytes": "bytes one pack call may hold (rule C8)",
    "window_documents": "at most this many documents per window",
    "window_tokens": "at most this many tokens per window (must exceed capacity)",
    "epochs": "passes over the corpus; 0 means unbounded",
    "shuffle": "shuffle documents per epoch with a permutation of (seed, epoch)",
    "seed": "shuffle seed",
    "shuffle_buffer": "documents held by the bounded shuffle of sources without random access",
    "policy": "placement: 'next_fit' (rule C2, in supplied order) or 'best_fit' (the open "
    "row with the least room that fits; fills more, same stream for any worker count)",
    "open_rows": "rows best_fit keeps open (default 16; next_fit keeps 1)",
    "tail": "epoch tail: 'fill' pads every rank to the same count with all-padding "
    "batches flagged filler; 'drop' drops the remainder",
    "accumulation": "micro-batches per rank in one optimizer step: each batch carries the "
    "loss-eligible targets of its whole step (world_size x accumulation batches)",
    "window_budget_bytes": "bytes of windows handed to workers and not yet complete",
    "reorder_budget_bytes": "bytes of packed batches held for ordering and delivery",
    "max_message_bytes": "largest message frame accepted (zmq.MAXMSGSIZE)",
    "heartbeat_timeout": "seconds of silence after which a worker's windows are reissued",
    "window_timeout": "seconds a worker may hold a window; then the window goes to another "
    "worker and the late one is dropped",
    "backups": "hand a copy of a window that is overdue (against the windows observed) "
    "to another worker, and take the first answer that passes the plan check",
    "backup_after": "seconds a window is in flight before it may get a backup copy (at "
    "least; more when the recent windows took longer: 4 x their p95)",
    "consumer_timeout": "seconds of silence after which a consumer's outstanding fetches are "
    "forgotten (a waiting client resends every few seconds)",
    "quarantine_path": "JSON Lines file receiving each quarantined document with its reason",
    "curve_secret_key_file": "file holding the producer's Z85 CURVE secret key; when set, "
    "both endpoints encrypt and only clients that know the public key can talk to it",
    "curve_server_key": "the producer's Z85 CURVE public key (when the producer uses CURVE)",
    "metrics_port": "serve Prometheus metrics at http://ADDRESS:PORT/metrics (unset: none)",
    "metrics_address": "address the metrics server listens on (0.0.0.0: every interface)",
    # One name, one concept, in each role's unit: what a client connects to, and how
    # many of what it receives it asks for ahead.
    "worker.connect": "the producer's worker_endpoint, to connect to",
    "consumer.connect": "the producer's consumer_endpoint, to connect to",
    "worker.prefetch": "windows requested ahead (the worker's credit)",
    "consumer.prefetch": "batches requested ahead (fetches outstanding)",
    "heartbeat_interval": "seconds between worker heartbeats",
    "audit_every": "audit every N-th packed batch with streampack.audit (0: never)",
    "data_plane": "who sends a batch's tokens to the consumer: 'producer', or 'workers' "
    "(the worker that packed it serves it; the consumer checks it against the producer's "
    "SHA-256 digest and falls back to the producer)",
    "route_timeout": "seconds a consumer waits for a worker to serve a routed batch before "
    "it asks the producer for it",
    "serve_endpoint": "where the worker binds to serve its batches to consumers (e.g. "
    "tcp://127.0.0.1:*; default: it does not serve)",
    "serve_advertise": "the endpoint consumers connect to for this worker's batches "
    "(default: serve_endpoint as bound; set it when that address is not reachable as is)",
    "store_bytes": "bytes of batches a serving worker keeps for consumers",
    "store_seconds": "seconds a serving worker keeps a batch no consumer has fetched",
    "prefetch_bytes": "bytes of batches a consumer holds ahead",
    "timeout": "seconds a consumer waits for a batch before raising",
}

S = TypeVar("S")

_SECTIONS: dict[type, str] = {
    ProducerSettings: "producer",
    WorkerSettings: "worker",
    ConsumerSettings: "consumer",
}


def read_curve_secret(path: str) -> bytes:
    """The Z85 secret key in ``path`` (surrounding whitespace ignored)."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise InvalidConfig(f"cannot read curve_secret_key_file {path!r}: {exc}") from exc
    problem = z85_key_problem(key)
    if problem:
        raise InvalidConfig(
            f"curve_secret_key_file {path!r} does not hold a CURVE secret key ({problem}); "
            f"expected a file holding the 40 Z85 characters of one"
        )
    return key


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a settings file; a syntax error becomes :class:`InvalidConfig` naming the file."""
    try:
        with open(path, "rb") as handle:
            return tomllib.load(handle)
    except OSError as exc:
        raise InvalidConfig(f"cannot read settings file {str(path)!r}: {exc}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise InvalidConfig(f"settings file {str(path)!r} is not valid TOML: {exc}") from exc


def build(
    cls: type[S], toml: Mapping[str, Any] | None = None, overrides: Mapping[str, Any] | None = None
) -> S:
    """Build settings of ``cls`` from a parsed TOML document and explicit overrides.

    ``overrides`` entries whose value is ``None`` are ignored: they are flags the user
    did not give.
    """
    names = {f.name for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    values: dict[str, Any] = {}
    section = _SECTIONS[cls]
    if toml:
        unknown_tables = set(toml) - set(_SECTIONS.values())
        if unknown_tables:
            raise InvalidConfig(
                f"unknown settings table(s) {', '.join(sorted(unknown_tables))}; "
                f"expected {', '.join(sorted(_SECTIONS.values()))}"
            )
        table = toml.get(section, {})
        if not isinstance(table, Mapping):
            raise InvalidConfig(f"[{section}] must be a table, got {table!r}")
        unknown = set(table) - names
        if unknown:
            raise InvalidConfig(
                f"unknown [{section}] setting(s) {', '.join(sorted(unknown))}; "
                f"accepted: {', '.join(sorted(names))}"
            )
        values.update(table)
    for key, value in (overrides or {}).items():
        if value is not None and key in names:
            values[key] = value
    return cls(**values)


#: Settings an environment variable may give, above the TOML file and below the flag: a
#: container spec sets them once for every process (and a key in a Secret stays off the
#: command line). An empty value counts as unset.
FIELD_ENV = {"curve_server_key": "STREAMPACK_CURVE_SERVER_KEY"}


def env_default(field: str) -> str | None:
    """The value the environment gives setting ``field`` (see ``FIELD_ENV``), or None."""
    return (os.environ.get(FIELD_ENV[field]) or None) if field in FIELD_ENV else None


def add_flags(parser: argparse.ArgumentParser, cls: type, *, skip: tuple[str, ...] = ()) -> None:
    """Add one ``--flag`` per setting of ``cls``; the default is None (= not given), or
    what the environment gives (``FIELD_ENV``)."""
    for field in dataclasses.fields(cls):
        if field.name in skip:
            continue
        flag = "--" + field.name.replace("_", "-")
        default = field.default
        described = FIELD_HELP.get(f"{_SECTIONS.get(cls)}.{field.name}")
        help_text = f"{described or FIELD_HELP.get(field.name, '')} (default: {default})"
        if field.name in FIELD_ENV:
            help_text += f"; the environment variable {FIELD_ENV[field.name]} may give it"
            parser.add_argument(
                flag, dest=field.name, default=env_default(field.name), help=help_text
            )
            continue
        if field.type in ("bool", bool):
            parser.add_argument(
                flag,
                dest=field.name,
                default=None,
                action=argparse.BooleanOptionalAction,
                help=help_text,
            )
            continue
        kind: Any = str
        if field.type in ("int", "int | None", int):
            kind = int
        elif field.type in ("float", float):
            kind = float
        parser.add_argument(flag, dest=field.name, type=kind, default=None, help=help_text)


def from_args(cls: type[S], args: argparse.Namespace) -> S:
    """Settings from ``--config`` (when given) overridden by the flags that were given."""
    toml = load_toml(args.config) if getattr(args, "config", None) else None
    overrides = {f.name: getattr(args, f.name, None) for f in dataclasses.fields(cls)}  # type: ignore[arg-type]
    return build(cls, toml, overrides)
