"""``streampack health``: ask a producer whether it is serving (exit 0) or not (exit 1).

Sends one ``health`` message to the producer's consumer endpoint and waits for its
``status`` answer, which carries the producer's counters; they are printed as JSON.
Suitable for container health checks: it never hangs longer than ``--timeout``.

A health probe is a client of the consumer endpoint, so it takes a consumer's
settings: ``--connect``, ``--curve-server-key`` and ``--max-message-bytes``, from
``--config``'s ``[consumer]`` table or the flags. Its ``--timeout`` is its own (a
probe answers in seconds; a consumer's ``timeout`` waits for batches).
"""

from __future__ import annotations

import argparse
import json

import zmq

from .. import wire
from ..errors import ProtocolError
from ..settings import (
    ConsumerSettings,
    add_flags,
    check_curve_key,
    check_endpoint,
    check_number,
    from_args,
)

#: Consumer settings that mean nothing to a probe of one message (how many batches to
#: ask for ahead, and how long to wait for a batch).
_UNUSED = ("prefetch", "prefetch_bytes", "timeout")


def check(
    endpoint: str,
    timeout: float,
    curve_server_key: str | None = None,
    max_message_bytes: int = ConsumerSettings.max_message_bytes,
) -> dict | None:
    """The producer's status, or None when it does not answer in time."""
    check_endpoint("connect", endpoint)
    check_number("timeout", timeout, minimum=0, inclusive=False)  # never wait forever
    check_curve_key("curve_server_key", curve_server_key)
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    try:
        wire.configure_socket(socket, max_message_bytes)
        if curve_server_key:
            wire.curve_client(socket, curve_server_key)
        wire.attach(socket, endpoint, field="connect", bind=False)
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
    parser.add_argument("--config", help="TOML settings file; its [consumer] table is read")
    parser.add_argument(
        "--timeout", type=float, default=5.0, help="seconds to wait for an answer (default: 5)"
    )
    add_flags(parser, ConsumerSettings, skip=_UNUSED)
    # The flag's name before it was --connect, as consume and worker call it: existing
    # probes (HEALTHCHECKs, manifests) keep working.
    parser.add_argument("--endpoint", dest="connect", help=argparse.SUPPRESS)


def main(args: argparse.Namespace) -> int:
    overrides = {**vars(args), "timeout": None}  # --timeout is the probe's, not a consumer's
    settings = from_args(ConsumerSettings, argparse.Namespace(**overrides))
    try:
        status = check(
            settings.connect, args.timeout, settings.curve_server_key, settings.max_message_bytes
        )
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
