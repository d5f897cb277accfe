"""A one-line progress display for long commands, shown on a terminal only.

    with Progress("rank 0", total=max_batches, unit="batches") as progress:
        for batch in stream:
            ...
            progress.update(done=n, tokens=t)

On a terminal the line is redrawn in place at most every ``interval`` seconds::

    rank 0: 120/400 batches  1.52 M tokens/s  ETA 0:00:18

Nothing at all is written when the stream is not a terminal (a pipe, a file, a log
collector) or when ``enabled=False`` (``--quiet``), so results on stdout and logs on
stderr stay clean. The rate and ETA count from the first ``update``.
"""

from __future__ import annotations

import sys
import time
from typing import IO


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    return f"{seconds // 3600}:{seconds // 60 % 60:02d}:{seconds % 60:02d}"


class Progress:
    """Progress of one command on one line; see the module docstring."""

    def __init__(
        self,
        label: str,
        *,
        total: int | None = None,
        unit: str = "batches",
        enabled: bool | None = None,
        stream: IO[str] | None = None,
        interval: float = 0.5,
    ) -> None:
        self.label = label
        self.total = total
        self.unit = unit
        self.stream = stream if stream is not None else sys.stderr
        isatty = getattr(self.stream, "isatty", None)
        terminal = bool(isatty and isatty())
        self.enabled = terminal if enabled is None else (enabled and terminal)
        self.interval = interval
        self._started: float | None = None
        self._last_draw = 0.0
        self._drawn = False

    def start(self) -> None:
        """Count the rate and ETA from now rather than from the first ``update``."""
        self._started = time.perf_counter()

    def line(
        self, done: int, tokens: int | None = None, now: float | None = None, note: str = ""
    ) -> str:
        """The text of the progress line (without the carriage return)."""
        now = time.perf_counter() if now is None else now
        if self._started is None:
            self._started = now
        elapsed = now - self._started
        count = f"{done}/{self.total}" if self.total is not None else f"{done}"
        parts = [f"{self.label}: {count} {self.unit}"]
        if tokens is not None and elapsed > 0:
            parts.append(f"{tokens / elapsed / 1e6:.2f} M tokens/s")
        if self.total is not None and 0 < done < self.total and elapsed > 0:
            parts.append(f"ETA {_duration(elapsed / done * (self.total - done))}")
        if note:
            parts.append(note)
        return "  ".join(parts)

    def update(self, done: int, tokens: int | None = None, note: str = "") -> None:
        """Redraw the line when enabled and ``interval`` has passed since the last."""
        now = time.perf_counter()
        if self._started is None:
            self._started = now
        if not self.enabled or now - self._last_draw < self.interval:
            return
        self._last_draw = now
        # \r back to the line's start, \x1b[K clears what a longer line left behind.
        self.stream.write("\r" + self.line(done, tokens, now, note) + "\x1b[K")
        self.stream.flush()
        self._drawn = True

    def close(self) -> None:
        """End the line (only when something was drawn)."""
        if self._drawn:
            self.stream.write("\n")
            self.stream.flush()
            self._drawn = False

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
