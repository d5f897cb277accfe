import os
import signal
import sys
import uuid
from pathlib import Path

# Compiled kernels are cached across runs; CI and `make test` set the same directory.
os.environ.setdefault("NUMBA_CACHE_DIR", str(Path(__file__).resolve().parents[1] / ".numba_cache"))

# Every process a test starts inherits this mark, so that the session can find the
# ones a failed or interrupted test left running (a stray worker would otherwise keep
# a core busy for whatever runs next on the machine, CI's Docker tests included).
SESSION_MARK = f"STREAMPACK_TEST_SESSION={uuid.uuid4().hex}"
os.environ["STREAMPACK_TEST_SESSION"] = SESSION_MARK.partition("=")[2]


def _marked_processes() -> list[int]:
    """Processes (other than this one) whose environment holds this session's mark."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            environment = (entry / "environ").read_bytes().split(b"\0")
        except OSError:  # gone, or not ours to read
            continue
        if SESSION_MARK.encode() in environment:
            found.append(int(entry.name))
    return found


def pytest_sessionfinish(session, exitstatus):
    if not sys.platform.startswith("linux"):
        return
    leftovers = _marked_processes()
    for pid in leftovers:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass
    if leftovers:
        print(
            f"\nconftest: killed {len(leftovers)} process(es) the tests left running: "
            f"{sorted(leftovers)}",
            file=sys.stderr,
        )
