"""``streampack health``: ask a producer whether it is serving (exit 0) or not (exit 1).

Sends one ``health`` message to the producer's consumer endpoint and waits for its
``status`` answer, which carries the producer's counters; they are printed as JSON.
Suitable for container health checks: it never hangs longer than ``--timeout``.
"""

from __future__ import annotations

import argparse
import json

import zmq

from .. import wire
from ..errors import ProtocolError
from ..settings import (
    FIELD_ENV,
    check_curve_key,
    check_endpoint,
    check_number,
    env_default,
)


def check(endpoint: str, timeout: float, curve_server_key: str | None = None) -> dict | None:
    """The producer's status, or None when it does not answer in time."""
    check_endpoint("endpoint", endpoint)
    check_number("timeout", timeout, minimum=0, inclusive=False)  # never wait forever
    check_curve_key("curve_server_key", curve_server_key)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    try:
        wire.configure_socket(socket, 1 << 24)
        if curve_server_key:
            wire.curve_client(socket, curve_server_key)
        wire.attach(socket, endpoint, field="endpoint", bind=False)
        socket.send_multipart(wire.encode("health", {}), copy=False)
        if not socket.poll(int(timeout * 1000), zmq.POLLIN):
            return None
        message = wire.decode(socket.recv_multipart(copy=False))
        if message.kind != "status":
            raise ProtocolError(f"expected a 'status' answer, got {message.kind!r}")
        return message.fields
    finally:
        socket.close(linger=0)
        context.term()


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--endpoint",
        default="tcp://127.0.0.1:5556",
        help="the producer's consumer endpoint (default: tcp://127.0.0.1:5556)",
    )
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default: 5)"
    )
    parser.add_argument(
        "--curve-server-key",
        default=env_default("curve_server_key"),
        help="the producer's Z85 CURVE public key, when it uses CURVE (or "
        f"the environment variable {FIELD_ENV['curve_server_key']})",
    )


def main(args: argparse.Namespace) -> int:
    try:
        status = check(args.endpoint, args.timeout, args.curve_server_key)
    except ProtocolError as exc:
        print(json.dumps({"serving": False, "error": str(exc)}), flush=True)
        return 1
    if status is None:
        print(
            json.dumps({"serving": False, "error": f"no answer within {args.timeout}s"}), flush=True
        )
        return 1
    print(json.dumps(status), flush=True)
    return 0 if status.get("serving") else 1
