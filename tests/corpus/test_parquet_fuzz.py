"""The Parquet fuzz tier: real files pyarrow wrote, damaged (``tests/_parquet_fuzz.py``
says how), read by the corpus reader in a child process, so that a segfault or a hang
is seen and reported as one. Every case must end ``equal`` (what the reader gives
with pyarrow decoding everything), ``refused`` or ``both_refuse`` (one line, a
streampack error naming the file); anything else fails.

    pytest tests/corpus/test_parquet_fuzz.py                         the seeded default
    PARQUET_FUZZ_EXAMPLES=5000 pytest tests/corpus/test_parquet_fuzz.py   more cases
    PARQUET_FUZZ_SEED=7 PARQUET_FUZZ_EXAMPLES=5000 pytest ...        other cases (seed 7)
    make parquet-fuzz PARQUET_FUZZ_EXAMPLES=5000 PARQUET_FUZZ_SEED=7  the same, counts shown

docs/service.md ("Parquet's pages against crafted files") lists the outcomes.
"""

from __future__ import annotations

import collections
import itertools
import os

import pytest
from _parquet_fuzz import BASES, FAILURES, Child, apply, layout, write_base
from hypothesis import HealthCheck, given, seed, settings
from hypothesis import strategies as st

EXAMPLES = int(os.environ.get("PARQUET_FUZZ_EXAMPLES") or 800)  # about 25 s on 2 cores
SEED = os.environ.get("PARQUET_FUZZ_SEED") or None
OUTCOMES: collections.Counter[str] = collections.Counter()
_numbers = itertools.count()


@pytest.fixture(scope="module")
def bases(tmp_path_factory):
    root = tmp_path_factory.mktemp("bases")
    found = {}
    for name in BASES:
        write_base(name, root / f"{name}.parquet")
        data = (root / f"{name}.parquet").read_bytes()
        found[name] = (data, layout(data, root / f"{name}.parquet"))
    return found


@pytest.fixture(scope="module")
def child(tmp_path_factory):
    """The reading process, its kernels loaded before any case is timed."""
    reader = Child()
    root = tmp_path_factory.mktemp("warm")
    write_base("dict-v1", root / "warm.parquet")
    assert reader.read(root / "warm.parquet", False, warm=True)[0] == "equal"
    yield reader
    reader.close()
    print(f"\nParquet fuzz outcomes: {dict(sorted(OUTCOMES.items()))}")


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    return tmp_path_factory.mktemp("cases")


def check(child, bases, cases, base: str, edits: list[tuple]) -> tuple[str, str]:
    """Reads ``base`` with ``edits`` applied; fails on an outcome of ``FAILURES``, a
    crash or a hang. Returns the outcome and its detail."""
    data, where = bases[base]
    path = cases / f"case-{next(_numbers)}.parquet"  # never one a reader still maps
    path.write_bytes(apply(data, where, edits))
    outcome, detail = child.read(path, BASES[base].get("labels", False))
    path.unlink()
    OUTCOMES[outcome] += 1
    assert outcome not in FAILURES | {"crash", "hang"}, f"{base} {edits}: {outcome}: {detail}"
    return outcome, detail


def _value(special: list[int], low: int, high: int) -> st.SearchStrategy:
    return st.one_of(st.sampled_from(special), st.integers(low, high))


FIELD_VALUES = st.one_of(
    st.tuples(
        st.just("set"),
        _value([0, 1, -1, 2**31 - 1, -(2**31), 2**32 + 3, 2**62, -(2**62)], -(2**63), 2**63 - 1),
    ),
    st.tuples(st.just("add"), st.integers(-3, 3)),
    st.tuples(st.sampled_from(["times", "over"]), st.integers(2, 1000)),
)
# An RLE run's header: zero runs, a few values, groups whose bytes overflow 64 bits.
RUN_HEADERS = _value(
    [0, 1, 2, 3, 2**31 - 1, 2**32 - 1, 2**32 + 1, 2**63 - 1, 2**63 + 7, 2**62 + 1, 2**64 - 1],
    0,
    2**64 - 1,
)
AT = st.integers(0, 10**6)
EDITS = st.one_of(
    st.tuples(st.just("flip"), AT, AT, st.integers(0, 255)),
    st.tuples(st.just("cut"), AT, AT, st.integers(1, 64)),
    st.tuples(st.just("truncate"), st.integers(0, 999)),
    st.tuples(st.just("header"), AT, AT, FIELD_VALUES),
    st.tuples(st.just("retype"), AT, AT, st.integers(1, 12)),
    st.tuples(st.just("footer"), AT, FIELD_VALUES),
    st.tuples(
        st.just("prefix"),
        AT,
        st.sampled_from(["rep", "def"]),
        _value([0, 1, 2**31 - 1, 2**31, 2**32 - 1], 0, 2**32 - 1),
    ),
    st.tuples(
        st.just("run"),
        AT,
        st.sampled_from(["rep", "def", "values"]),
        RUN_HEADERS,
        st.integers(0, 255),
    ),
    st.tuples(st.just("width"), AT, _value([0, 1, 31, 32, 33, 63, 64, 255], 0, 255)),
)


def _seeded(test):
    return test if SEED is None else seed(int(SEED))(test)


@_seeded
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    derandomize=SEED is None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(base=st.sampled_from(sorted(BASES)), edits=st.lists(EDITS, min_size=1, max_size=3))
def test_a_damaged_file_reads_as_pyarrow_reads_it_or_is_refused(child, bases, cases, base, edits):
    check(child, bases, cases, base, edits)


#: Inputs the tier found (or that were built for what it found) that crashed the reader
#: or gave tokens where pyarrow refuses the bytes, before the page reader checked them:
#: (what happened, base, edits). Field paths are Thrift field ids from the outer struct.
REGRESSIONS = {
    "segfault: a bit-packed run header of 2**61 groups; its byte count for 7-bit "
    "indices overflowed 64 bits and the kernel read outside the page": (
        "int8",
        [("run", 0, "values", 2**62 + 1, 0)],
    ),
    "abort: pyarrow's codec accessor on a codec number it does not know (2**32 - 1)": (
        "one-token",
        [("footer", (4, 1, 1, 0, 3, 4), ("set", -1))],
    ),
    "abort: pyarrow's chunk metadata on a schema repetition type of -1 (a level "
    "histogram of the wrong size)": ("plain-v1", [("footer", (2, 3, 3), ("set", -1))]),
    "tokens where pyarrow refuses: a snappy page's decompressed size 64 bytes too "
    "large (pyarrow's decompress leaves the rest uninitialized)": (
        "snappy-plain",
        [("header", 0, (2,), ("add", 64))],
    ),
    "the same with gzip": ("gzip-dict", [("header", 1, (2,), ("add", 40))]),
    "tokens where pyarrow refuses: a page header's type given as an i64, which "
    "pyarrow's Thrift does not read as the field": ("small-pages-v2", [("retype", 3, (1,), 6)]),
    "tokens where pyarrow refuses: a chunk's physical type INT64 in an INT32 column": (
        "snappy-dict-v1",
        [("footer", (4, 0, 1, 0, 3, 1), ("add", 1))],
    ),
    "out of memory (pyarrow alone; a hang in the child): a row group said to hold "
    "267589442999 rows; pyarrow sizes its reading by them": (
        "uint16",
        [("footer", (4, 2, 3), ("set", 267589442999))],
    ),
    "a message of three lines (pyarrow's, passed on as it was)": ("wide-dict", [("flip", 0, 0, 0)]),
}


@pytest.mark.parametrize("found", REGRESSIONS)
def test_an_input_that_once_crashed_or_misread_is_read_as_pyarrow_reads_it(
    child, bases, cases, found
):
    base, edits = REGRESSIONS[found]
    outcome, detail = check(child, bases, cases, base, edits)
    if found.startswith("out of memory"):  # (the child's memory bound makes pyarrow's
        assert "a corrupt footer" in detail  # allocation fail cleanly: refused before it)
