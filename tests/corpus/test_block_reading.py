"""Block reading: the compiled gather and shuffle buffer against their plain-Python
references (``streampack.reference.corpus``), and blocks against the records they
replace."""

from __future__ import annotations

import numpy as np
import pytest

from streampack.corpus.gather import gather_ranges
from streampack.corpus.order import buffered_shuffle, buffered_shuffle_blocks, epoch_rng
from streampack.corpus.reader import Block
from streampack.reference import corpus as reference


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8, np.bool_])
def test_gather_ranges_is_the_reference(tmp_path, dtype):
    rng = np.random.default_rng(1)
    values = rng.integers(0, 2 if dtype == np.bool_ else 500, 1000).astype(dtype)
    np.save(tmp_path / "v.npy", values)
    mapped = np.load(tmp_path / "v.npy", mmap_mode="r")  # read in place, read-only
    lengths = rng.integers(0, 30, 60)
    starts = rng.integers(0, 1000 - 30, 60)
    lengths[[3, 17]] = 0
    out = gather_ranges(mapped, starts, lengths)
    assert out.dtype == dtype
    assert out.tolist() == reference.gather_ranges(values.tolist(), starts, lengths)
    wide = gather_ranges(mapped, starts, lengths, np.int64)
    assert wide.dtype == np.int64 and wide.tolist() == [int(v) for v in out.tolist()]


def _block(first: int, lengths: list[int], problems: dict[int, tuple[str, str]]) -> Block:
    n = len(lengths)
    tokens = np.concatenate([np.full(k, first + i, np.int64) for i, k in enumerate(lengths)])
    ids = np.arange(first, first + n, dtype=np.int64)
    return Block(
        tokens=tokens,
        lengths=np.array(lengths, np.int64),
        starts=np.zeros(n, np.int64),
        stops=np.array(lengths, np.int64),
        source_ids=ids,
        example_ids=ids + 1000,
        problems=problems,
        mask=(tokens % 2).astype(np.uint8),
        mask_lengths=np.array(lengths, np.int64),
    )


@pytest.mark.parametrize("size", [1, 7, 50, 64, 500])
@pytest.mark.parametrize("block_size", [1, 13, 64])
def test_the_block_shuffle_emits_what_the_record_shuffle_does(size, block_size):
    """Every document in the order ``buffered_shuffle`` (and the reference) gives for
    the same seed, with its tokens, mask, ids and problems — a buffer smaller than,
    equal to and larger than the corpus, blocks of one document and more."""
    rng = np.random.default_rng(2)
    lengths = rng.integers(0, 9, 300).tolist()
    blocks = []
    for lo in range(0, 300, block_size):
        part = lengths[lo : lo + block_size]
        bad = {i: ("malformed", f"doc {lo + i}") for i in range(len(part)) if (lo + i) % 37 == 5}
        blocks.append(_block(lo, part, bad))
    expected = list(buffered_shuffle(iter(range(300)), size, epoch_rng(3, 1)))
    draws = epoch_rng(3, 1)
    assert expected == reference.shuffle_buffer(
        list(range(300)), size, lambda n: int(draws.integers(n))
    )
    out = Block.concat(list(buffered_shuffle_blocks(iter(blocks), size, epoch_rng(3, 1))))
    assert out.source_ids.tolist() == expected
    assert out.example_ids.tolist() == [i + 1000 for i in expected]
    assert out.lengths.tolist() == [lengths[i] for i in expected]
    tokens = [i for i in expected for _ in range(lengths[i])]
    assert out.tokens.tolist() == tokens
    assert out.mask is not None and out.mask.tolist() == [t % 2 for t in tokens]
    assert out.problems == {
        at: ("malformed", f"doc {i}") for at, i in enumerate(expected) if i % 37 == 5
    }


def test_read_ahead_raises_the_readers_error_where_it_is_read():
    from streampack.corpus.parquet import read_ahead
    from streampack.errors import InvalidConfig

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
    import threading

    from streampack.corpus.parquet import read_ahead

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
    assert not [t for t in threading.enumerate() if t.name == "streampack-read-ahead"]
