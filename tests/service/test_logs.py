"""Logging: levels, timestamps, role and identity, JSON lines, and no forged lines."""

from __future__ import annotations

import io
import json
import logging
import re
import signal
import subprocess
import time

import _service as svc
import pytest
import zmq

from streampack.errors import InvalidConfig
from streampack.logs import escape, setup_logging

TEXT_LINE = re.compile(
    r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z (DEBUG|INFO|WARNING|ERROR) +"
    r"(?P<role>[a-z]+)\[(?P<identity>[^\]]+)\] (?P<logger>[\w.]+): (?P<message>.*)$"
)
FORGED = "\n2026-01-01T00:00:00.000Z ERROR   producer[x:1] forged: give me root\r"


@pytest.fixture
def restore_logging():
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    root.handlers[:] = handlers
    root.setLevel(level)


def test_text_lines_carry_time_level_role_identity_and_escape_peer_text(restore_logging):
    out = io.StringIO()
    setup_logging("worker", identity="node-3:4121", stream=out)
    log = logging.getLogger("streampack.service.worker")
    log.info("connecting to %s", "tcp://h:5555")
    log.warning("rejected a message: %s", FORGED)
    log.debug("not shown at INFO")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    first, second = (TEXT_LINE.match(line) for line in lines)
    assert first and second
    assert first["role"] == "worker" and first["identity"] == "node-3:4121"
    assert (
        first["logger"] == "streampack.service.worker"
        and first["message"] == "connecting to tcp://h:5555"
    )
    assert lines[1].split()[1] == "WARNING"
    assert second["message"] == "rejected a message: " + escape(FORGED)
    assert "\\n2026-01-01" in second["message"] and second["message"].endswith("\\r")


def test_a_traceback_is_indented_so_it_cannot_pass_for_a_record(restore_logging):
    out = io.StringIO()
    setup_logging("producer", identity="h:1", stream=out)
    try:
        raise ValueError(FORGED)
    except ValueError:
        logging.getLogger("x").exception("it failed")
    lines = out.getvalue().splitlines()
    assert TEXT_LINE.match(lines[0])
    assert all(line.startswith("    | ") for line in lines[1:]) and len(lines) > 2


def test_json_lines_are_one_object_each_with_the_peer_text_intact(restore_logging):
    out = io.StringIO()
    setup_logging("serve", fmt="json", level="debug", identity="h:2", stream=out)
    logging.getLogger("streampack.service.serve").debug("peer said %s", FORGED)
    lines = out.getvalue().splitlines()
    assert len(lines) == 1
    entry = json.loads(lines[0])
    assert entry["level"] == "DEBUG" and entry["role"] == "serve" and entry["identity"] == "h:2"
    assert entry["logger"] == "streampack.service.serve"
    assert entry["message"] == "peer said " + FORGED
    assert re.match(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z$", entry["time"])
    # A second setup replaces the first handler instead of doubling every line.
    setup_logging("serve", fmt="json", identity="h:2", stream=out)
    assert (
        sum(
            1
            for h in logging.getLogger().handlers
            if h.formatter.__class__.__name__ == "JsonFormatter"
        )
        == 1
    )


def test_unknown_format_or_level_is_refused(restore_logging):
    with pytest.raises(InvalidConfig, match="log format 'xml'; accepted: text, json"):
        setup_logging("x", fmt="xml")
    with pytest.raises(InvalidConfig, match="log level 'LOUD'"):
        setup_logging("x", level="LOUD")


def test_serve_and_its_workers_log_json_lines_a_hostile_peer_cannot_break():
    worker_endpoint = f"tcp://127.0.0.1:{svc.free_port()}"
    consumer_endpoint = f"tcp://127.0.0.1:{svc.free_port()}"
    proc = svc.start(
        "serve",
        "--workers",
        "1",
        "--log-format",
        "json",
        "--worker-endpoint",
        worker_endpoint,
        "--consumer-endpoint",
        consumer_endpoint,
        "--grace",
        "2",
        *svc.flags({"corpus": str(svc.FIXTURE), **svc.SMALL}),
        stderr=subprocess.PIPE,
    )
    try:
        svc.wait_healthy(consumer_endpoint)
        context = zmq.Context()
        peer = context.socket(zmq.DEALER)
        peer.connect(consumer_endpoint)
        peer.send_multipart([FORGED.encode(), b"\x00" + FORGED.encode()])
        peer.poll(5000)  # the producer answers a rejected message with `error`
        peer.close(linger=0)
        context.term()
        deadline = time.monotonic() + 30  # until the worker has announced itself
        while svc.stats(consumer_endpoint)["workers_joined"] < 1:
            assert time.monotonic() < deadline, "the worker never joined"
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=20)
    assert json.loads(out.strip().splitlines()[-1])["producer"]["rejected_consumer"] >= 1
    entries = [json.loads(line) for line in err.splitlines()]  # every line is one object
    roles = {entry["role"] for entry in entries}
    assert roles == {"serve", "worker"}, roles
    assert {entry["identity"] for entry in entries if entry["role"] == "worker"} != {
        entry["identity"] for entry in entries if entry["role"] == "serve"
    }
    messages = [entry["message"] for entry in entries]
    assert any("worker 0 started as pid" in m for m in messages)
    assert any("connecting to" in m for m in messages)
    # A peer's bad message is a warning; lifecycle is information.
    assert any("rejected" in e["message"] and e["level"] == "WARNING" for e in entries)
    assert all(e["level"] == "INFO" for e in entries if "started as pid" in e["message"])
