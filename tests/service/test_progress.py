"""Progress lines: drawn in place on a terminal, nothing on a pipe or with --quiet."""

from __future__ import annotations

import io
import os
import pty
import subprocess

import _service as svc

from streampack.progress import Progress


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_a_terminal_gets_one_line_redrawn_with_rate_and_eta():
    out = Terminal()
    progress = Progress("rank 0", total=10, stream=out, interval=0.0)
    progress.start()
    progress._started -= 2.0  # two seconds ago
    progress.update(4, tokens=8_000_000)
    progress.close()
    text = out.getvalue()
    assert text.startswith("\rrank 0: 4/10 batches  4.00 M tokens/s  ETA 0:00:03")
    assert text.endswith("\x1b[K\n") and text.count("\n") == 1


def test_no_total_means_no_eta_and_quiet_or_a_pipe_means_nothing():
    out = Terminal()
    progress = Progress("demo", stream=out, interval=0.0)
    progress.update(3, tokens=10)
    assert "ETA" not in out.getvalue() and "demo: 3 batches" in out.getvalue()
    for stream, enabled in ((Terminal(), False), (io.StringIO(), None), (io.StringIO(), True)):
        quiet = Progress("x", total=5, stream=stream, enabled=enabled, interval=0.0)
        quiet.update(1, tokens=1)
        quiet.close()
        assert stream.getvalue() == ""


def _consume_stderr(endpoint: str, terminal: bool, *extra: str) -> str:
    """Run `streampack consume` (without --quiet) with stderr a pty or a pipe."""
    args = svc.command(
        "consume",
        "--connect",
        endpoint,
        "--rank",
        "0",
        "--world-size",
        "1",
        "--timeout",
        "60",
        "--delay",
        "0.3",
        *extra,
    )
    if not terminal:
        proc = subprocess.run(
            args, cwd=svc.ROOT, env=svc.env(), capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        return proc.stderr
    leader, follower = pty.openpty()
    proc = subprocess.Popen(
        args, cwd=svc.ROOT, env=svc.env(), stdout=subprocess.PIPE, stderr=follower
    )
    os.close(follower)
    chunks = []
    while True:
        try:
            chunk = os.read(leader, 4096)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        chunks.append(chunk)
    proc.communicate(timeout=120)
    os.close(leader)
    assert proc.returncode == 0
    return b"".join(chunks).decode()


def test_consume_shows_progress_on_a_terminal_only():
    with svc.Service(svc.FIXTURE, serve_workers=1) as service:
        shown = _consume_stderr(service.consumer_endpoint, True, "--max-batches", "6")
        piped = _consume_stderr(service.consumer_endpoint, False, "--max-batches", "2")
        quiet = _consume_stderr(service.consumer_endpoint, True, "--max-batches", "2", "--quiet")
    assert "\rrank 0: " in shown and "/6 batches" in shown and "waiting for data" in shown
    assert "\r" not in piped and "batches" not in piped
    assert "\r" not in quiet and "batches" not in quiet
