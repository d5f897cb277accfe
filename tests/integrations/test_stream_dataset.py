"""``StreamDataset`` in plain PyTorch loops: torchdata's ``StatefulDataLoader`` saves
and restores the stream's cursor (nothing of the prefix served again), and the loaders
that would collate, copy or split the stream are refused with one line."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch", reason="the torch extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")

from _trainers import fingerprint  # noqa: E402
from test_hf_trainer import oracle  # noqa: E402

import streampack as sp  # noqa: E402
from streampack.integrations.torch import StreamDataset  # noqa: E402


def test_a_stateful_dataloader_resumes_the_stream_at_its_cursor_without_replaying(service):
    stateful = pytest.importorskip("torchdata.stateful_dataloader", reason="no torchdata")
    want = [fingerprint(b.to_hf(pad_id=0)) for b in oracle(service.settings, 0, 1, count=8)]
    with sp.BatchStream(service.consumer_endpoint, rank=0, world_size=1, prefetch=1) as stream:
        loader = stateful.StatefulDataLoader(StreamDataset(stream, pad_id=0), batch_size=None)
        items = iter(loader)
        first = [next(items) for _ in range(4)]
        state = loader.state_dict()
    assert first[0]["input_ids"].shape == (4, 256)  # one whole packed batch, not collated
    before = service.stats()["batches_served"]
    with sp.BatchStream(service.consumer_endpoint, rank=0, world_size=1, prefetch=1) as stream:
        loader = stateful.StatefulDataLoader(StreamDataset(stream, pad_id=0), batch_size=None)
        loader.load_state_dict(state)
        rest = [item for _, item in zip(range(4), loader)]
    served = service.stats()["batches_served"] - before
    assert [fingerprint(item) for item in first + rest] == want
    # Without the dataset's state, torchdata fast-forwards: 4 batches read again, 8 served.
    assert 4 <= served <= 5


def test_a_dataloader_that_collates_or_copies_the_stream_is_refused():
    stream = sp.BatchStream("tcp://127.0.0.1:9", rank=0, world_size=1, timeout=5)
    dataset = StreamDataset(stream, pad_id=0)
    with pytest.raises(
        sp.InvalidConfig, match="a DataLoader with batch_size=1 is reading a StreamDataset"
    ):
        next(iter(torch.utils.data.DataLoader(dataset)))
    with pytest.raises(sp.InvalidConfig, match="with num_workers > 0 every worker reads"):
        next(iter(torch.utils.data.DataLoader(dataset, batch_size=None, num_workers=1)))
    stream.close()
