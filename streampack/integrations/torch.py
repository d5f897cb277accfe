"""``StreamDataset``: one rank's ``BatchStream`` as a ``torch.utils.data.IterableDataset``.

Each item is one whole ``PackedBatch`` in transformers' convention
(``batch.to_hf(pad_id=..., num_items_in_batch=True)``: ``input_ids``, ``position_ids``,
``shift_labels``/``labels``, ``num_items_in_batch`` = the step's ``step_targets``), so
a batch is never collated with another: read it with ``batch_size=None``::

    stream = sp.BatchStream(endpoint, rank=rank, world_size=world_size)
    dataset = StreamDataset(stream, pad_id=0)
    loader = StatefulDataLoader(dataset, batch_size=None)   # or torch's DataLoader
    for inputs in loader:
        loss = model(**inputs).loss * world_size             # NLL sum / step_targets, x W
        ...
    checkpoint["data"] = loader.state_dict()                 # every rank's cursor
    loader.load_state_dict(checkpoint["data"])               # also at another world size

``state_dict()`` is ``{"ranks": [every rank's BatchStream.state_dict()]}``: gathered
over the default ``torch.distributed`` process group when one of the stream's world
size is initialized (a collective: call it on every rank, as a checkpoint does), this
rank's alone otherwise. ``load_state_dict`` hands the list to
``BatchStream.load_state_dict``, which resumes exactly, at this world size or another
(``client.resume_cursor``), with nothing replayed: the producer starts at the cursor.

Why the checks in ``__iter__`` (each is a way a stream goes wrong silently):

- ``DataLoader(dataset)`` collates ``batch_size=1`` items by default: every tensor gets
  a leading dimension and ``num_items_in_batch`` becomes a tensor. Refused: give
  ``batch_size=None``.
- ``num_workers > 0`` gives every worker process its own copy of the dataset, and each
  would read the stream: refused (the ``BatchStream`` already fetches ahead).
- accelerate's prepared loaders (``accelerate.data_loader.prepare_data_loader``) either
  read on rank 0 only and split each batch across the ranks (``dispatch_batches``, the
  default for an ``IterableDataset``) or keep one item in ``num_processes`` on each rank
  (``IterableDatasetShard``): a rank's stream is already its own, so both lose or mix
  batches. Refused; ``streampack.integrations.hf`` hands the stream to Trainer without
  them.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator, Mapping, Sequence
from types import FrameType
from typing import Any

from streampack.batch import PackedBatch
from streampack.client import BatchStream
from streampack.errors import InvalidConfig, StreampackError

try:
    import torch
    import torch.distributed
    from torch.utils.data import IterableDataset
    from torch.utils.data._utils.fetch import _BaseDatasetFetcher
except ImportError as error:  # pragma: no cover - depends on the environment
    raise StreampackError(
        "streampack.integrations.torch needs PyTorch; install it with: "
        "pip install 'streampack[torch]'"
    ) from error

#: How far up the call stack ``__iter__`` looks for the loader that is reading it.
_CALLERS = 24

_COLLATED = (
    "a DataLoader with batch_size={size} is reading a StreamDataset: it would collate "
    "{size} packed batches into one (every tensor gains a leading dimension); each item "
    "is already a whole batch, so give DataLoader(dataset, batch_size=None)"
)
_WORKERS = (
    "a DataLoader worker process is reading a StreamDataset: with num_workers > 0 every "
    "worker reads its own copy of the stream, so batches would repeat; use num_workers=0 "
    "(the BatchStream already fetches ahead: its prefetch)"
)
_ACCELERATE = (
    "accelerate's prepared DataLoader is reading a StreamDataset: with dispatch_batches "
    "(its default for an IterableDataset) rank 0 would read its own stream for every rank "
    "and split each batch, and without it IterableDatasetShard keeps one batch in "
    "num_processes of each rank's stream; hand the dataset to transformers through "
    "streampack.integrations.hf.StreamTrainer (or read it with a plain DataLoader, "
    "batch_size=None, not prepared by accelerate)"
)


def _check_reader() -> None:
    """Refuse the loaders that would mix, repeat or drop this rank's batches (module doc).

    The loader is found on the call stack: ``iter(dataset)`` is called by torch's
    fetcher (which knows whether it collates) inside whatever wraps the DataLoader, and
    nothing else tells a dataset who reads it."""
    if torch.utils.data.get_worker_info() is not None:
        raise InvalidConfig(_WORKERS)
    frames: list[FrameType] = []
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and len(frames) < _CALLERS:
        frames.append(frame)
        frame = frame.f_back
    # accelerate's loaders collate too: name the wrapper, the cause to fix first.
    if any(f.f_globals.get("__name__") == "accelerate.data_loader" for f in frames):
        raise InvalidConfig(_ACCELERATE)
    for frame in frames:
        reader = frame.f_locals.get("self")
        if isinstance(reader, _BaseDatasetFetcher) and reader.auto_collation:
            raise InvalidConfig(_COLLATED.format(size=_batch_size(frame)))


def _batch_size(frame: Any) -> object:
    """The collating DataLoader's batch_size, for the message (found further up)."""
    while frame is not None:
        for name in ("loader", "self"):
            loader = frame.f_locals.get(name)
            if isinstance(loader, torch.utils.data.DataLoader):
                return loader.batch_size
        frame = frame.f_back
    return "N"


def gather_states(state: dict[str, int], world_size: int) -> list[dict[str, int]]:
    """Every rank's ``state``, in rank order, when the default process group spans the
    stream's ``world_size`` ranks (a collective); ``[state]`` otherwise."""
    distributed = torch.distributed
    if (
        world_size > 1
        and distributed.is_available()
        and distributed.is_initialized()
        and distributed.get_world_size() == world_size
    ):
        states: list[Any] = [None] * world_size
        distributed.all_gather_object(states, state)
        return states
    return [state]


def saved_states(state: object) -> Any:
    """What ``BatchStream.load_state_dict`` takes, from a ``state_dict()`` of this module
    (``{"ranks": [...]}``), a list of cursors, or one cursor."""
    if isinstance(state, Mapping) and "ranks" in state:
        ranks = state["ranks"]
        if not isinstance(ranks, Sequence) or isinstance(ranks, (str, bytes)) or not ranks:
            raise InvalidConfig(
                f"state {dict(state)!r}: 'ranks' is {ranks!r}; expected the non-empty list of "
                "every rank's cursor that StreamDataset.state_dict() saves"
            )
        return list(ranks)
    return state


class StreamDataset(IterableDataset):
    """One rank's ``BatchStream`` as an ``IterableDataset`` of ``to_hf`` dicts (module doc).

    Args:
        stream: this rank's ``BatchStream``.
        pad_id, mask, mask_dtype: as ``PackedBatch.to_hf`` (rows layout).
        num_items_in_batch: pass each batch's ``step_targets`` as ``num_items_in_batch``
            (default), so the model's loss is the NLL sum over its step's count.

    Iterating again continues the stream where the last iteration stopped; ``batch``
    is the ``PackedBatch`` last yielded (``stream.current`` its (epoch, index)).
    """

    def __init__(
        self,
        stream: BatchStream,
        *,
        pad_id: int,
        mask: str | None = None,
        mask_dtype: Any = None,
        num_items_in_batch: bool = True,
    ) -> None:
        if not isinstance(stream, BatchStream):
            raise InvalidConfig(
                f"stream={stream!r}; expected a streampack BatchStream (this rank's)"
            )
        self.stream = stream
        self.num_items_in_batch = num_items_in_batch
        self._arguments: dict[str, Any] = {
            "pad_id": pad_id,
            "mask": mask,
            "mask_dtype": mask_dtype,
            "num_items_in_batch": num_items_in_batch,
        }
        self.batch: PackedBatch | None = None

    def __iter__(self) -> Iterator[dict[str, Any]]:
        _check_reader()
        return self._items()

    def _items(self) -> Iterator[dict[str, Any]]:
        while True:
            try:
                batch = self.stream.next_batch()
            except StopIteration:
                return
            self.batch = batch
            yield batch.to_hf(**self._arguments)

    def state_dict(self) -> dict[str, Any]:
        """``{"ranks": [...]}``: every rank's cursor (module doc; a collective when the
        process group is initialized)."""
        return {"ranks": gather_states(self.stream.state_dict(), self.stream.world_size)}

    def load_state_dict(self, state: Mapping[str, Any] | Sequence[Mapping[str, int]]) -> None:
        """Continue from ``state_dict()``'s value (or a list of cursors, or one)."""
        self.stream.load_state_dict(saved_states(state))
