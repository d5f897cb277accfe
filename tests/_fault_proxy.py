"""A proxy on loopback between a corpus reader and a store's HTTP port that the test
controls: each request meets one fault, drawn from a seeded stream of draws.

    reader ──▶ 127.0.0.1:PORT (this proxy) ──▶ 127.0.0.1:UPSTREAM (weed's S3 gateway)

    fault      what the reader sees
    none       the store's answer
    drop       the connection closed before any answer
    cut        the connection closed halfway through the answer (mid-body; for a HEAD,
               mid-headers)
    delay      the store's answer, ``delay_seconds`` late
    throttle   ``503 SlowDown`` with S3's XML error body, the store never asked

It reads HTTP/1.1 messages (Content-Length or chunked bodies), so the reader's
keep-alive connections carry many requests and each gets its own draw; the bytes go
through untouched (a signed request's ``Host`` stays the one it was signed for). The
``n``-th request meets the ``n``-th draw, whatever the threads' timing. ``counts``
says how many requests met each fault.
"""

from __future__ import annotations

import collections
import contextlib
import random
import socket
import threading
import time
from collections.abc import Iterator

FAULTS = ("drop", "cut", "delay", "throttle")

SLOWDOWN_BODY = (
    b'<?xml version="1.0" encoding="UTF-8"?>\n'
    b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message>"
    b"<RequestId>fault-proxy</RequestId></Error>"
)
_TIMEOUT = 30.0  # seconds any one socket operation may take: nothing here waits forever


def _slowdown(head_only: bool) -> bytes:
    body = b"" if head_only else SLOWDOWN_BODY
    return (
        b"HTTP/1.1 503 Slow Down\r\nContent-Type: application/xml\r\n"
        b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
    )


def _read_message(stream, *, bodiless: bool = False) -> tuple[bytes, int] | None:
    """One HTTP message read whole from ``stream`` (its bytes, and where its body
    starts); None at a clean end of the connection."""
    head = bytearray()
    while True:
        line = stream.readline(65537)
        if not line:
            if head:
                raise ConnectionError("the connection ended inside a message's headers")
            return None
        head += line
        if line in (b"\r\n", b"\n"):
            break
    fields = {}
    for line in bytes(head).split(b"\r\n")[1:]:
        name, _, value = line.partition(b":")
        fields[name.strip().lower()] = value.strip().lower()
    status = bytes(head).split(b" ", 2)
    if head.startswith(b"HTTP/") and len(status) > 1 and status[1][:1] in (b"1",):
        bodiless = True
    if head.startswith(b"HTTP/") and len(status) > 1 and status[1] in (b"204", b"304"):
        bodiless = True
    body = bytearray()
    if not bodiless and fields.get(b"transfer-encoding") == b"chunked":
        while True:
            size_line = stream.readline(1024)
            body += size_line
            size = int(size_line.split(b";")[0], 16)
            body += stream.read(size + 2)  # the chunk and its CRLF
            if size == 0:
                break
    elif not bodiless:
        length = int(fields.get(b"content-length", b"0"))
        body += stream.read(length)
        if len(body) != length:
            raise ConnectionError("the connection ended inside a message's body")
    return bytes(head) + bytes(body), len(head)


class FaultProxy:
    """See the module. ``shares`` maps a fault to the share of requests that meet it."""

    def __init__(
        self,
        upstream_port: int,
        *,
        seed: int,
        delay_seconds: float = 0.25,
        **shares: float,
    ) -> None:
        unknown = set(shares) - set(FAULTS)
        assert not unknown, f"unknown faults {sorted(unknown)}; known: {FAULTS}"
        assert sum(shares.values()) < 1, "some requests must get through"
        self.upstream = ("127.0.0.1", upstream_port)
        self.shares = shares
        self.delay_seconds = delay_seconds
        self.counts: collections.Counter[str] = collections.Counter()
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self._sockets: set[socket.socket] = set()
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.port = self._listener.getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    def _draw(self) -> str:
        with self._lock:
            draw = self._rng.random()
            fault = "none"
            for name, share in self.shares.items():
                if draw < share:
                    fault = name
                    break
                draw -= share
            self.counts["requests"] += 1
            self.counts[fault] += 1
            return fault

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            client.settimeout(_TIMEOUT)
            self._track(client)
            threading.Thread(target=self._serve, args=(client,), daemon=True).start()

    def _track(self, sock: socket.socket, keep: bool = True) -> None:
        with self._lock:
            (self._sockets.add if keep else self._sockets.discard)(sock)

    def _serve(self, client: socket.socket) -> None:
        upstream: socket.socket | None = None
        up_stream = None
        from_client = client.makefile("rb")
        try:
            while True:
                request = _read_message(from_client)
                if request is None:
                    return
                message, _ = request
                head_only = message.startswith(b"HEAD ")
                fault = self._draw()
                if fault == "drop":
                    return
                if fault == "throttle":
                    client.sendall(_slowdown(head_only))
                    continue
                if upstream is None:
                    upstream = socket.create_connection(self.upstream, timeout=_TIMEOUT)
                    self._track(upstream)
                    up_stream = upstream.makefile("rb")
                upstream.sendall(message)
                answer = _read_message(up_stream, bodiless=head_only)
                if answer is None:
                    return
                response, body_at = answer
                if fault == "delay":
                    time.sleep(self.delay_seconds)
                if fault == "cut":
                    body = len(response) - body_at
                    client.sendall(response[: body_at + body // 2 if body else body_at // 2])
                    return
                client.sendall(response)
                if b"\r\nconnection: close" in response[:body_at].lower():
                    return
        except (OSError, ValueError, ConnectionError):
            return
        finally:
            for sock in (client, upstream):
                if sock is not None:
                    self._track(sock, keep=False)
                    with contextlib.suppress(OSError):
                        sock.close()

    def faults(self) -> int:
        """Requests that met a fault a retry must mend (not the delayed ones)."""
        return sum(self.counts[name] for name in ("drop", "cut", "throttle"))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            live = list(self._sockets)
        for sock in live:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
                sock.close()
        self._thread.join(5)


@contextlib.contextmanager
def fault_proxy(upstream_port: int, *, seed: int, **options: float) -> Iterator[FaultProxy]:
    proxy = FaultProxy(upstream_port, seed=seed, **options)
    try:
        yield proxy
    finally:
        proxy.close()
