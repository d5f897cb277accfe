"""The data plane's routing table (``data_plane = "workers"``). Plain Python, no sockets.

A worker that serves announces its consumer endpoint (``serving``). When the producer
accepts a worker's plan of a window that it sent with its tokens, that worker holds the
window's batches (``service/store.py``), so each of them can go to its consumer as a
*route* — the endpoint, and the route digest the producer computes from its own
window without gathering the batch (``service/planned.py``, ``wire.route_digest``) —
instead of with its tokens. The plan check is the producer's; the digest is what lets
the consumer trust bytes that came from a worker, since the worker cannot make other
bytes hash to it.

Bounds: at most ``MAX_ENDPOINTS`` announced endpoints (past that the oldest is
forgotten: its windows' batches then go with their tokens) and ``MAX_WINDOWS`` routed
windows (the oldest forgotten first, with the same effect). A consumer that reports a
digest mismatch (``reroute`` with reason "digest") makes the producer refuse that
endpoint from then on: it is never routed to again, whatever the worker announces.
A consumer can report a mismatch that did not happen; that costs the data plane one
worker (its batches go through the producer, as without a data plane), never a byte
of the stream.
"""

from __future__ import annotations

import collections

from ..errors import InvalidConfig, ProtocolError
from ..settings import check_endpoint
from .registry import WindowKey

MAX_ENDPOINTS = 4096
MAX_WINDOWS = 1 << 16
MAX_REFUSED = 4096


class Routes:
    """Which worker serves which window's batches, and the endpoints refused."""

    def __init__(self) -> None:
        self.endpoints: collections.OrderedDict[bytes, str] = collections.OrderedDict()
        self.windows: collections.OrderedDict[WindowKey, bytes] = collections.OrderedDict()
        self.refused: collections.OrderedDict[str, None] = collections.OrderedDict()

    def announce(self, identity: bytes, endpoint: str) -> None:
        """Worker ``identity`` serves consumers at ``endpoint`` (``ProtocolError`` if
        it is not an endpoint a consumer could connect to)."""
        try:
            check_endpoint("serving endpoint", endpoint)
        except InvalidConfig as exc:
            raise ProtocolError(str(exc)) from None
        if "*" in endpoint:
            raise ProtocolError(
                f"serving endpoint {endpoint!r} has a wildcard; a worker announces the "
                "address it bound (or serve_advertise)"
            )
        self.endpoints.pop(identity, None)
        self.endpoints[identity] = endpoint
        while len(self.endpoints) > MAX_ENDPOINTS:
            self.endpoints.popitem(last=False)

    def accepted(self, key: WindowKey, identity: bytes, with_tokens: bool) -> None:
        """The plan of window ``key`` from ``identity`` passed the check; the worker
        holds its batches if it had the window's tokens and serves."""
        self.windows.pop(key, None)
        if with_tokens and identity in self.endpoints:
            self.windows[key] = identity
            while len(self.windows) > MAX_WINDOWS:
                self.windows.popitem(last=False)

    def lost(self, identity: bytes) -> None:
        """A worker gone (silent, dropped, unreachable): nothing more is routed to it."""
        self.endpoints.pop(identity, None)

    def endpoint(self, epoch: int, window: int) -> str | None:
        """Where the batches of window (epoch, window) are served, or None."""
        identity = self.windows.get((epoch, window))
        if identity is None:
            return None
        endpoint = self.endpoints.get(identity)
        if endpoint is None or endpoint in self.refused:
            return None
        return endpoint

    def refuse(self, endpoint: str) -> bool:
        """Never route to ``endpoint`` again; True when it was not refused before (an
        endpoint no worker announced is not a route anyone was given: ignored)."""
        if endpoint in self.refused or endpoint not in self.endpoints.values():
            return False
        self.refused[endpoint] = None
        while len(self.refused) > MAX_REFUSED:
            self.refused.popitem(last=False)
        return True
