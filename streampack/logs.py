"""Logging for every streampack process: one setup function, two formats.

Modules log through ``logging.getLogger(__name__)``; each process calls
``setup_logging`` once (``streampack.cli`` does, for every subcommand) to send records
to stderr with a timestamp, the level, the process role (the subcommand) and its
identity (``host:pid``, a pod's name under Kubernetes):

- ``text`` (the default), for people::

      2026-11-30T21:40:12.345Z INFO    worker[node-3:4121] streampack.service.worker: connecting ...

- ``json``, for log shippers: one JSON object per line with the keys ``time``,
  ``level``, ``role``, ``identity``, ``logger``, ``message`` (and ``exception``).

Messages often quote what a peer sent (an error string, an audit note). A peer must
not be able to forge a log line with it, so the text format escapes every character
that is not printable (``\\n`` becomes the two characters ``\\`` ``n``) and indents a
traceback's lines; JSON escapes them by construction.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import socket
import sys
import time
from typing import IO, Any

FORMATS = ("text", "json")
LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR")

#: Environment variables giving the defaults of ``--log-format`` and ``--log-level``
#: (handy in container specs, where every process should log alike).
FORMAT_ENV = "STREAMPACK_LOG_FORMAT"
LEVEL_ENV = "STREAMPACK_LOG_LEVEL"


def escape(text: str) -> str:
    """``text`` with every non-printable character written as its escape sequence."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)


def _timestamp(record: logging.LogRecord) -> str:
    seconds = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
    return f"{seconds}.{int(record.msecs):03d}Z"


class TextFormatter(logging.Formatter):
    """One line per record, for people; see the module docstring."""

    def __init__(self, role: str, identity: str) -> None:
        super().__init__()
        self.prefix = f"{escape(role)}[{escape(identity)}]"

    def format(self, record: logging.LogRecord) -> str:
        line = (
            f"{_timestamp(record)} {record.levelname:<7} {self.prefix} {record.name}: "
            f"{escape(record.getMessage())}"
        )
        if record.exc_info:
            trace = self.formatException(record.exc_info)
            line += "".join(f"\n    | {escape(part)}" for part in trace.splitlines())
        return line


class JsonFormatter(logging.Formatter):
    """One JSON object per record, for log shippers; see the module docstring."""

    def __init__(self, role: str, identity: str) -> None:
        super().__init__()
        self.role = role
        self.identity = identity

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": _timestamp(record),
            "level": record.levelname,
            "role": self.role,
            "identity": self.identity,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False)


class _Handler(logging.StreamHandler):
    """The handler ``setup_logging`` installs (a second call replaces it). Without a
    stream of its own it writes to whatever ``sys.stderr`` is at the time."""

    def __init__(self, stream: IO[str] | None) -> None:
        self._own_stream = stream
        super().__init__(stream)

    @property
    def stream(self) -> IO[str]:
        return self._own_stream if self._own_stream is not None else sys.stderr

    @stream.setter
    def stream(self, value: IO[str]) -> None:
        pass  # StreamHandler.__init__ assigns it; the property decides


def default_identity() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


def setup_logging(
    role: str,
    *,
    fmt: str = "text",
    level: str = "INFO",
    identity: str | None = None,
    stream: IO[str] | None = None,
) -> None:
    """Send this process's log records to ``stream`` (stderr) in format ``fmt``.

    ``role`` names the process (``producer``, ``worker``, ``serve``, ``consume``, ...);
    ``identity`` tells apart processes of one role (default ``host:pid``). Calling it
    again replaces the handler it installed before; other handlers are left alone.
    """
    if fmt not in FORMATS:
        from .errors import InvalidConfig

        raise InvalidConfig(f"log format {fmt!r}; accepted: {', '.join(FORMATS)}")
    if level.upper() not in LEVELS:
        from .errors import InvalidConfig

        raise InvalidConfig(f"log level {level!r}; accepted: {', '.join(LEVELS)}")
    identity = identity or default_identity()
    formatter = (JsonFormatter if fmt == "json" else TextFormatter)(role, identity)
    handler = _Handler(stream)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    root.addHandler(handler)
    root.setLevel(level.upper())


def add_logging_flags(parser: argparse.ArgumentParser) -> None:
    """``--log-format`` and ``--log-level``, defaulting to the environment's choice."""
    parser.add_argument(
        "--log-format",
        choices=FORMATS,
        default=os.environ.get(FORMAT_ENV, "text"),
        help=f"diagnostics on stderr as text for people or one JSON object "
        f"per line (default: ${FORMAT_ENV} or text)",
    )
    parser.add_argument(
        "--log-level",
        choices=LEVELS,
        type=str.upper,
        default=os.environ.get(LEVEL_ENV, "INFO").upper(),
        help=f"least severe level logged (default: ${LEVEL_ENV} or INFO)",
    )


def logging_args(args: argparse.Namespace) -> list[str]:
    """The flags that give a child process this process's logging choices."""
    return ["--log-format", args.log_format, "--log-level", args.log_level]
