"""Work done on background threads a bounded way ahead of whoever takes it: the
Parquet reader's decoders and read-ahead, and ``corpus build``'s stages.

Both helpers hand items over in their input order, raise a background thread's
exception where the item it was making would have been taken, and stop their threads
when closed (the consumer stopped or failed): nothing runs on, nothing is lost."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Generator, Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from queue import Full, Queue
from typing import Any, TypeVar

_In = TypeVar("_In")
_Out = TypeVar("_Out")


def read_ahead(
    items: Iterable[_Out], depth: int, name: str = "streampack-read-ahead"
) -> Generator[_Out, None, None]:
    """``items``, produced on a thread named ``name`` at most ``depth`` ahead of the
    consumer (memory: ``depth`` items queued, one being made, one being used)."""
    queue: Queue[tuple[BaseException | None, Any]] = Queue(maxsize=depth)
    stop = threading.Event()
    done = object()

    def put(entry: tuple[BaseException | None, Any]) -> bool:
        while not stop.is_set():
            try:
                queue.put(entry, timeout=0.05)
                return True
            except Full:
                continue
        return False

    def run() -> None:
        try:
            for item in items:
                if not put((None, item)):
                    return
            put((None, done))
        except BaseException as exc:  # handed to the consumer, raised there
            put((exc, None))

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        while True:
            error, item = queue.get()
            if error is not None:
                raise error
            if item is done:
                return
            yield item
    finally:
        stop.set()
        thread.join()


def map_in_order(
    function: Callable[[_In], _Out], items: Iterable[_In], threads: int, ahead: int, name: str
) -> Generator[_Out, None, None]:
    """``function`` of every item, computed on ``threads`` threads (named from
    ``name``) and handed back in the order of ``items``, with at most ``ahead`` items
    submitted and not yet taken; closing drops the ones not yet started."""
    pool = ThreadPoolExecutor(threads, thread_name_prefix=name)
    pending: deque[Future[_Out]] = deque()
    try:
        for item in items:
            pending.append(pool.submit(function, item))
            if len(pending) >= ahead:
                yield pending.popleft().result()
        while pending:
            yield pending.popleft().result()
    finally:
        pool.shutdown(wait=True, cancel_futures=True)
