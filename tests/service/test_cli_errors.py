"""User mistakes end in one line on stderr that names what is wrong, the value and what
is accepted; a non-zero exit; no traceback. Bugs (``InternalError``) keep theirs."""

from __future__ import annotations

import argparse
import re
import socket as pysocket
import subprocess
import sys
import threading
import time

import pytest
import zmq
from _service import DASH_PUBLIC, DASH_SECRET, FIXTURE, ROOT, command, env

from streampack import InternalError, InvalidConfig, cli, wire
from streampack.settings import (
    ConsumerSettings,
    add_flags,
    check_curve_key,
    check_endpoint,
    from_args,
)

NOT_Z85 = "!" * 39 + '"'  # 40 characters, the last one outside Z85

ENDPOINT_FORMS = re.escape(
    "expected tcp://HOST:PORT (PORT 1-65535 or *), ipc://PATH or inproc://NAME"
)
OUTPUT_DIR = re.escape("expected a file path in an existing, writable directory")
CURSOR = re.escape('expected a JSON cursor as --state-out writes, e.g. {"epoch": 0, "index": 0}')
PUBLIC_KEY = re.escape(
    "expected the 40 Z85 characters of the producer's public key (see docs/service.md, Security)"
)
NOT_Z85_TEXT = re.escape("(it is not Z85 text (ZeroMQ's printable key encoding))")
IN_USE = "cannot bind it: Address already in use; choose a free port or stop the process using it"
NOWHERE = "tcp://127.0.0.1:1"  # a consumer that fails at startup never connects

# (id, arguments, the one stderr line as a regular expression). In arguments, {tmp} is
# a scratch directory and {busy} a port another socket holds.
CASES = [
    (
        "produce-port-in-use",
        [
            "produce",
            "--corpus",
            "{fixture}",
            "--worker-endpoint",
            "tcp://127.0.0.1:{busy}",
            "--consumer-endpoint",
            "tcp://127.0.0.1:{free}",
        ],
        rf"streampack produce: error: worker_endpoint = 'tcp://127\.0\.0\.1:\d+': {IN_USE}",
    ),
    (
        "serve-port-in-use",
        [
            "serve",
            "--corpus",
            "{fixture}",
            "--worker-endpoint",
            "tcp://127.0.0.1:{free}",
            "--consumer-endpoint",
            "tcp://127.0.0.1:{busy}",
        ],
        rf"streampack serve: error: consumer_endpoint = 'tcp://127\.0\.0\.1:\d+': {IN_USE}",
    ),
    *[
        (
            f"{name}-port-not-a-number",
            [name, flag, "tcp://127.0.0.1:notaport", *extra],
            rf"streampack {name}: error: {field} = 'tcp://127\.0\.0\.1:notaport' is not a ZeroMQ "
            rf"endpoint \(port 'notaport' is not a number in 1-65535 or \*\); {ENDPOINT_FORMS}",
        )
        for name, flag, field, extra in [
            ("produce", "--worker-endpoint", "worker_endpoint", ["--corpus", "{fixture}"]),
            ("worker", "--connect", "connect", []),
            ("health", "--connect", "connect", []),
            ("consume", "--connect", "connect", []),
        ]
    ],
    *[
        (
            f"{name}-host-not-an-address",
            [name, flag, "tcp://256.1.1.1:5555", *extra],
            rf"streampack {name}: error: {field} = 'tcp://256\.1\.1\.1:5555' is not a ZeroMQ "
            rf"endpoint \(host '256\.1\.1\.1' is not a valid IP address\); {ENDPOINT_FORMS}",
        )
        for name, flag, field, extra in [
            ("produce", "--consumer-endpoint", "consumer_endpoint", ["--corpus", "{fixture}"]),
            ("worker", "--connect", "connect", []),
            ("health", "--connect", "connect", []),
        ]
    ],
    (
        "consume-connect-refused-by-zeromq",
        ["consume", "--connect", "tcp://127.0.0.1:*"],
        r"streampack consume: error: endpoint = 'tcp://127\.0\.0\.1:\*': cannot connect to it: "
        r"Invalid argument",
    ),
    (
        "health-no-scheme",
        ["health", "--connect", "127.0.0.1:5556"],
        r"streampack health: error: connect = '127\.0\.0\.1:5556' is not a ZeroMQ endpoint "
        rf"\(it has no tcp://, ipc:// or inproc:// scheme\); {ENDPOINT_FORMS}",
    ),
    *[
        (
            f"health-{name}",
            ["health", *args],
            r"streampack health: error: connect = '127\.0\.0\.1:5556' is not a ZeroMQ endpoint "
            rf"\(it has no tcp://, ipc:// or inproc:// scheme\); {ENDPOINT_FORMS}",
        )
        for name, args in [
            # The [consumer] table of --config, as consume reads it.
            ("reads-its-config", ["--config", "{tmp}/c.toml"]),
            # The flag's old name still gives connect.
            ("old-flag-name", ["--endpoint", "127.0.0.1:5556"]),
        ]
    ],
    (
        "health-message-limit-from-config",
        ["health", "--config", "{tmp}/small.toml"],
        r"streampack health: error: max_message_bytes = 100 must be an integer >= 4096",
    ),
    (
        "produce-quarantine-in-missing-directory",
        ["produce", "--corpus", "{fixture}", "--quarantine-path", "{tmp}/missing/q.jsonl"],
        r"streampack produce: error: quarantine_path = '.*/missing/q\.jsonl': directory "
        rf"'.*/missing' does not exist; {OUTPUT_DIR}",
    ),
    (
        "inspect-png-in-missing-directory",
        ["inspect", "--png", "{tmp}/missing/x.png"],
        r"streampack inspect: error: --png = '.*/missing/x\.png': directory '.*/missing' does "
        rf"not exist; {OUTPUT_DIR}",
    ),
    (
        "consume-state-in-missing",
        ["consume", "--connect", NOWHERE, "--state-in", "{tmp}/none.json"],
        rf"streampack consume: error: --state-in '.*/none\.json': No such file or directory; "
        rf"{CURSOR}",
    ),
    (
        "consume-state-in-not-json",
        ["consume", "--connect", NOWHERE, "--state-in", "{tmp}/not.json"],
        r"streampack consume: error: --state-in '.*/not\.json' is not JSON \(Expecting value: "
        rf"line 1 column 1 \(char 0\)\); {CURSOR}",
    ),
    (
        "consume-state-in-not-a-cursor",
        [
            "consume",
            "--connect",
            NOWHERE,
            "--rank",
            "0",
            "--world-size",
            "2",
            "--state-in",
            "{tmp}/odd.json",
        ],
        r"streampack consume: error: --state-in '.*/odd\.json': state \{'epoch': 0, 'index': 1\} "
        r"is not a cursor of rank 0 of 2: expected ints epoch >= 0, .*",
    ),
    (
        "consume-state-out-in-missing-directory",
        ["consume", "--connect", NOWHERE, "--state-out", "{tmp}/missing/state.json"],
        r"streampack consume: error: --state-out = '.*/missing/state\.json': directory "
        rf"'.*/missing' does not exist; {OUTPUT_DIR}",
    ),
    (
        "digest-world-size-0",
        ["digest", "--corpus", "{fixture}", "--world-size", "0"],
        r"streampack digest: error: world_size = 0 must be an integer >= 1",
    ),
    *[
        (
            f"{name}-rank-outside-world",
            [name, *extra, "--rank", "5", "--world-size", "2"],
            rf"streampack {name}: error: rank = 5 is not a rank of world_size 2; "
            r"expected an integer in 0\.\.1",
        )
        for name, extra in [
            ("digest", ["--corpus", "{fixture}"]),
            ("consume", ["--connect", NOWHERE]),
        ]
    ],
    (
        "digest-missing-corpus",
        ["digest", "--corpus", "/nonexistent/corpus"],
        r"streampack digest: error: .*corpus manifest '/nonexistent/corpus'.*; "
        r"give a manifest JSON file or a directory holding manifest\.json",
    ),
    *[
        (
            f"{name}-secret-key-not-z85",
            [name, "--corpus", "{fixture}", "--curve-secret-key-file", "{tmp}/bad.key"],
            rf"streampack {name}: error: curve_secret_key_file '.*/bad\.key' does not hold a CURVE "
            rf"secret key {NOT_Z85_TEXT}; expected a file holding the 40 Z85 characters of one",
        )
        for name in ("produce", "serve")
    ],
    *[
        (
            f"{name}-server-key-not-z85",
            [name, *extra, "--curve-server-key", NOT_Z85],
            rf"streampack {name}: error: curve_server_key = '{re.escape(NOT_Z85)}' is not a CURVE "
            rf"public key {NOT_Z85_TEXT}; {PUBLIC_KEY}",
        )
        for name, extra in [("consume", ["--connect", NOWHERE]), ("worker", []), ("health", [])]
    ],
    *[
        (
            f"{name}-{flag[2:]}-{value}",
            [name, *extra, flag, value],
            rf"streampack {name}: error: {field} = {shown} must be {rule}",
        )
        for name, extra, flag, value, field, shown, rule in [
            ("health", [], "--timeout", "-1", "timeout", r"-1\.0", "a number > 0"),
            ("health", [], "--timeout", "nan", "timeout", "nan", "a number > 0"),
            (
                "consume",
                ["--connect", NOWHERE],
                "--delay",
                "-1",
                "--delay",
                r"-1\.0",
                "a number >= 0",
            ),
            (
                "consume",
                ["--connect", NOWHERE],
                "--max-batches",
                "-1",
                "--max-batches",
                "-1",
                "an integer >= 0",
            ),
            (
                "digest",
                ["--corpus", "{fixture}"],
                "--max-batches",
                "-1",
                "--max-batches",
                "-1",
                "an integer >= 0",
            ),
            (
                "serve",
                ["--corpus", "{fixture}"],
                "--workers",
                "0",
                "--workers",
                "0",
                "an integer >= 1",
            ),
            (
                "serve",
                ["--corpus", "{fixture}"],
                "--grace",
                "-1",
                "--grace",
                r"-1\.0",
                "a number >= 0",
            ),
        ]
    ],
    (
        "digest-no-corpus",
        ["digest"],
        r"streampack digest: error: corpus is not set; pass --corpus PATH or set corpus in the "
        r"\[producer\] table",
    ),
    (
        "digest-unbounded",
        ["digest", "--corpus", "{fixture}", "--epochs", "0"],
        r"streampack digest: error: epochs = 0 is an unbounded stream; give --max-batches N",
    ),
    (
        "demo-workers-0",
        ["demo", "--workers", "0"],
        r"streampack demo: error: --workers = 0 must be an integer >= 1",
    ),
    (
        "demo-serve-refuses",
        ["demo", "--corpus", "/nonexistent/corpus", "--log-level", "ERROR"],
        r"streampack demo: error: serve exited with status 2: streampack serve: error: "
        r".*corpus manifest '/nonexistent/corpus'.*",
    ),
    (
        "serve-bad-worker-setting",
        ["serve", "--corpus", "{fixture}", "--config", "{tmp}/w.toml"],
        r"streampack serve: error: prefetch = 0 must be an integer >= 1",
    ),
]


@pytest.fixture
def busy_port():
    """A port another socket is listening on."""
    with pysocket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        yield holder.getsockname()[1]


@pytest.mark.parametrize(
    ("args", "line"), [case[1:] for case in CASES], ids=[case[0] for case in CASES]
)
def test_a_user_mistake_ends_in_one_line(tmp_path, busy_port, args, line):
    (tmp_path / "not.json").write_text("nope")
    (tmp_path / "odd.json").write_text('{"epoch": 0, "index": 1}')
    (tmp_path / "bad.key").write_text(NOT_Z85 + "\n")
    (tmp_path / "w.toml").write_text("[worker]\nprefetch = 0\n")
    (tmp_path / "c.toml").write_text('[consumer]\nconnect = "127.0.0.1:5556"\n')
    (tmp_path / "small.toml").write_text("[consumer]\nmax_message_bytes = 100\n")
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        free = probe.getsockname()[1]
    argv = [a.format(tmp=tmp_path, busy=busy_port, free=free, fixture=FIXTURE) for a in args]
    run = subprocess.run(
        command(*argv, "--timeout", "1") if argv[0] == "consume" else command(*argv),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode != 0
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert len(lines) == 1 and re.fullmatch(line, lines[0]), run.stderr


@pytest.mark.parametrize(
    "endpoint",
    [
        "tcp://127.0.0.1:5555",
        "tcp://0.0.0.0:1",
        "tcp://*:65535",
        "tcp://127.0.0.1:*",
        "tcp://streampack-producer:5556",
        "tcp://[::1]:5555",
        "ipc:///tmp/x.sock",
        "inproc://a",
    ],
)
def test_endpoints_zeromq_accepts_pass(endpoint):
    check_endpoint("connect", endpoint)


@pytest.mark.parametrize(
    ("endpoint", "problem"),
    [
        ("127.0.0.1:5555", "it has no tcp://, ipc:// or inproc:// scheme"),
        ("udp://127.0.0.1:5555", "it has no tcp://, ipc:// or inproc:// scheme"),
        ("tcp://127.0.0.1", "it has no :PORT"),
        ("tcp://127.0.0.1:0", "port '0' is not a number in 1-65535 or *"),
        ("tcp://127.0.0.1:70000", "port '70000' is not a number in 1-65535 or *"),
        ("tcp://:5555", "host '' is not an IP address, a host name or *"),
        ("tcp://a b:5555", "host 'a b' is not an IP address, a host name or *"),
        ("tcp://256.1.1.1:5555", "host '256.1.1.1' is not a valid IP address"),
        ("tcp://[::g]:5555", "host '[::g]' is not a valid IP address"),
        ("ipc://", "the ipc:// address is empty"),
    ],
)
def test_endpoints_zeromq_refuses_are_refused_before_any_socket(endpoint, problem):
    with pytest.raises(InvalidConfig, match=re.escape(f"({problem}); expected tcp://HOST:PORT")):
        check_endpoint("connect", endpoint)


def test_curve_keys_are_checked_as_z85():
    check_curve_key("curve_server_key", DASH_PUBLIC)
    assert zmq.curve_public(DASH_SECRET.encode()).decode() == DASH_PUBLIC
    for key, problem in [
        (NOT_Z85, "it is not Z85 text"),
        ("#" * 40, "it is not Z85 text"),
        (DASH_PUBLIC[:-1], "it has 39 characters, not 40"),
    ]:
        with pytest.raises(InvalidConfig, match=re.escape(problem)):
            check_curve_key("curve_server_key", key)


def test_batch_stream_refuses_a_bad_key_at_once():
    from streampack.client import BatchStream

    with pytest.raises(InvalidConfig, match="curve_server_key = .* is not a CURVE public key"):
        BatchStream("tcp://127.0.0.1:1", rank=0, world_size=1, curve_server_key=NOT_Z85)


def test_a_refused_endpoint_leaves_no_socket_to_wait_for():
    """``attach`` closes the socket ZeroMQ refused, so terminating the context returns."""
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    with pytest.raises(
        InvalidConfig,
        match="connect = 'tcp://127.0.0.1:notaport': cannot connect to it: Invalid argument",
    ):
        wire.attach(socket, "tcp://127.0.0.1:notaport", field="connect", bind=False)
    terminated = threading.Thread(target=context.term, daemon=True)
    terminated.start()
    terminated.join(5.0)
    assert not terminated.is_alive()


def test_a_key_beginning_with_a_dash_is_a_value_not_an_option():
    # health then runs with the key and fails only because no producer answers.
    run = subprocess.run(
        command(
            "health",
            "--connect",
            f"tcp://127.0.0.1:{_free_port()}",
            "--timeout",
            "0.2",
            "--curve-server-key",
            DASH_PUBLIC,
        ),
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 1 and '"serving": false' in run.stdout, run.stderr


def _free_port() -> int:
    with pysocket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_top_level_handler_keeps_tracebacks_for_bugs(monkeypatch, capsys):
    from streampack.service import digest

    def broken(args):
        raise InternalError("an invariant broke")

    monkeypatch.setattr(digest, "main", broken)
    with pytest.raises(InternalError):
        cli.main(["digest", "--corpus", str(FIXTURE)])

    def unwritable(args):
        raise PermissionError(13, "Permission denied", "/root/x")

    monkeypatch.setattr(digest, "main", unwritable)
    assert cli.main(["digest", "--corpus", str(FIXTURE)]) == 2
    assert capsys.readouterr().err == "streampack digest: error: Permission denied: '/root/x'\n"


def test_supervisor_backs_off_then_gives_up_on_a_worker_that_cannot_start():
    from streampack.service.serve import Supervisor

    gave_up = threading.Event()
    supervisor = Supervisor(
        1,
        lambda slot: [sys.executable, "-c", "raise SystemExit(3)"],
        grace=1.0,
        max_failures=4,
        backoff=(0.05, 0.2),
        on_give_up=gave_up.set,
    )
    started = time.monotonic()
    supervisor.start()
    assert gave_up.wait(30.0)
    supervisor.stop()
    # Pauses of 0.05, 0.1 and 0.2 s came between the four starts.
    assert time.monotonic() - started >= 0.35
    assert supervisor.restarts == 3
    assert supervisor.failure == (
        "worker 0 exited 4 times in a row within 10s of starting (last exit status 3); "
        "giving up: see the worker's error above"
    )


def test_supervisor_keeps_a_worker_that_runs():
    from streampack.service.serve import Supervisor

    supervisor = Supervisor(
        2, lambda slot: [sys.executable, "-c", "import time; time.sleep(60)"], grace=1.0
    )
    supervisor.start()
    time.sleep(0.5)
    pids = supervisor.pids()
    supervisor.stop()
    assert len(pids) == 2 and supervisor.restarts == 0 and not supervisor.failure
    assert supervisor.pids() == []


@pytest.mark.slow  # about 10 s: five starts with pauses of 0.2 to 1.6 s between them
def test_serve_gives_up_on_workers_that_cannot_start(tmp_path):
    """The real ``serve``, whose worker command is a program that fails at once: it
    stops after five tries with one line and a non-zero exit, not restarting forever."""
    failing = tmp_path / "python"
    failing.write_text("#!/bin/sh\necho 'worker: cannot start' >&2\nexit 3\n")
    failing.chmod(0o755)
    serve = (
        "import sys; sys.executable = sys.argv.pop(1)\n"
        "from streampack.cli import main\nsys.exit(main(sys.argv[1:]))"
    )
    run = subprocess.run(
        [
            sys.executable,
            "-c",
            serve,
            str(failing),
            "serve",
            "--corpus",
            str(FIXTURE),
            "--workers",
            "1",
            "--worker-endpoint",
            f"tcp://127.0.0.1:{_free_port()}",
            "--consumer-endpoint",
            f"tcp://127.0.0.1:{_free_port()}",
            "--log-level",
            "ERROR",
        ],
        cwd=ROOT,
        env=env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "Traceback" not in run.stderr
    lines = run.stderr.strip().splitlines()
    assert lines == ["worker: cannot start"] * 5 + [
        "streampack serve: error: worker 0 exited 5 times in a row within 10s of starting "
        "(last exit status 3); giving up: see the worker's error above"
    ]


@pytest.mark.parametrize("name", ["worker", "consume", "health"])
def test_the_server_key_may_come_from_the_environment(name):
    """STREAMPACK_CURVE_SERVER_KEY gives the key (a bad one here: its refusal shows it
    was read)."""
    environment = env() | {"STREAMPACK_CURVE_SERVER_KEY": NOT_Z85}
    argv = command(name) if name == "worker" else command(name, "--timeout", "1")
    run = subprocess.run(
        argv, cwd=ROOT, env=environment, capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 2 and "Traceback" not in run.stderr
    assert run.stderr.startswith(
        f"streampack {name}: error: curve_server_key = '{NOT_Z85}' is not a CURVE public key"
    )


@pytest.mark.parametrize(("value", "expected"), [("", None), (DASH_PUBLIC, DASH_PUBLIC)])
def test_an_empty_environment_key_is_no_key(monkeypatch, value, expected):
    monkeypatch.setenv("STREAMPACK_CURVE_SERVER_KEY", value)
    parser = argparse.ArgumentParser()
    add_flags(parser, ConsumerSettings)
    assert from_args(ConsumerSettings, parser.parse_args([])).curve_server_key == expected
    assert (
        from_args(
            ConsumerSettings, parser.parse_args(["--curve-server-key", "0" * 40])
        ).curve_server_key
        == "0" * 40
    )  # the flag wins


@pytest.mark.parametrize("name", [name for name, _, _ in cli.COMMANDS])
def test_every_subcommand_still_has_its_help(name, capsys):
    with pytest.raises(SystemExit) as stopped:
        cli.main([name, "--help"])
    assert stopped.value.code == 0
    assert capsys.readouterr().out.startswith(f"usage: streampack {name} ")
