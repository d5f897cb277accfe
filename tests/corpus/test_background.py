"""The background stages the Parquet reader and ``corpus build`` run on: bounded,
in order, errors raised where they belong, threads stopped when closed."""

from __future__ import annotations

import random
import threading
import time

import pytest

from streampack.corpus.background import map_in_order, read_ahead
from streampack.errors import InvalidConfig


def threads_named(prefix: str) -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(prefix)]


def test_read_ahead_raises_the_readers_error_where_it_is_read():
    def groups():
        yield 1
        yield 2
        raise InvalidConfig("row group 2 cannot be read")

    seen = []
    with pytest.raises(InvalidConfig, match="row group 2 cannot be read"):
        for item in read_ahead(groups(), 1):
            seen.append(item)
    assert seen == [1, 2]


def test_read_ahead_stays_bounded_and_stops_when_closed():

    made = []

    def groups():
        for i in range(100):
            made.append(i)
            yield i

    items = read_ahead(groups(), 2)
    assert next(items) == 0
    threading.Event().wait(0.2)
    assert len(made) <= 4  # one used, two queued, one being made
    items.close()
    assert threads_named("streampack-read-ahead") == []


def test_map_in_order_hands_results_back_in_input_order_whatever_finishes_first():
    delays = random.Random(0).choices([0.0, 0.001, 0.01], k=60)

    def slow_square(n: int) -> int:
        time.sleep(delays[n])  # later items often finish before earlier ones
        return n * n

    assert list(map_in_order(slow_square, range(60), 4, 8, "test-map")) == [
        n * n for n in range(60)
    ]
    assert threads_named("test-map") == []


def test_map_in_order_stays_bounded_and_stops_when_closed():
    started = []

    def record(n: int) -> int:
        started.append(n)
        return n

    results = map_in_order(record, range(1000), 3, 6, "test-map")
    assert next(results) == 0
    time.sleep(0.2)  # time enough for an unbounded map to run far ahead
    assert len(started) <= 6  # the one taken and five submitted behind it
    results.close()
    assert len(started) <= 6 and threads_named("test-map") == []


def test_map_in_order_raises_an_items_error_where_that_item_is_taken():
    def fail_on_three(n: int) -> int:
        if n == 3:
            raise InvalidConfig("item 3 is bad")
        return n

    taken = []
    with pytest.raises(InvalidConfig, match="item 3 is bad"):
        for n in map_in_order(fail_on_three, range(10), 2, 4, "test-map"):
            taken.append(n)
    assert taken == [0, 1, 2] and threads_named("test-map") == []
