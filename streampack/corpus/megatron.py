"""Megatron indexed datasets: a ``PREFIX.idx`` index and a ``PREFIX.bin`` token file,
both memory-mapped (no Megatron import).

The index, little-endian::

    b"MMIDIDX\\x00\\x00"      9 bytes, the magic
    version                  uint64, 1
    dtype code               uint8: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64,
                             6 float64, 7 float32, 8 uint16 (the .bin's token dtype)
    sequence count S         uint64
    document index count     uint64: D + 1 for D documents
    sequence lengths         int32[S], tokens per sequence
    sequence pointers        int64[S], byte offset of each sequence in the .bin
    document indices         int64[D + 1], document d is sequences [idx[d], idx[d + 1])
    (sequence modes          int8[S], multimodal datasets only: ignored)

A document of the corpus is a Megatron *document* (its sequences are contiguous in the
``.bin``); for data prepared without sentence splitting every sequence is a document.

A remote dataset (a URL: :mod:`streampack.corpus.storage`) reads its ``.idx`` whole
when opened (the index, once) and then only the byte ranges of the ``.bin`` that a
window's documents hold.

The format has no place for a supervision mask: a ``mask`` or ``labels`` key on a
Megatron source is refused (:mod:`streampack.corpus.masks`).
"""

from __future__ import annotations

import os
import struct
from typing import Any

import numpy as np

from streampack.corpus.files import regular_file
from streampack.corpus.offsets import OffsetsReader, Part, check_offsets
from streampack.corpus.reader import BindingSpec
from streampack.corpus.storage import CorpusPath, RemoteArray, RemoteFile, Url, read_bytes
from streampack.errors import InternalError, InvalidConfig

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
_HEADER = struct.Struct("<9sQBQQ")  # magic, version, dtype code, sequences, document indices
_CHUNK = 1 << 20


class _DocumentOffsets:
    """Token offsets of documents, computed from the memory-mapped pointers on each
    access: document ``d`` starts at token ``pointers[idx[d]] // itemsize``."""

    def __init__(
        self, pointers: np.ndarray, documents: np.ndarray, itemsize: int, total: int
    ) -> None:
        self._pointers = np.asarray(pointers)  # plain views: no memmap per index taken
        self._documents = np.asarray(documents)
        self._shift = itemsize.bit_length() - 1  # itemsizes are 1, 2, 4 or 8 bytes
        self._total = total

    def __len__(self) -> int:
        return len(self._documents)

    def __getitem__(self, key: Any) -> Any:
        from streampack.kernels.corpus_cpu import document_token_starts

        if isinstance(key, slice) or np.ndim(key) == 0 or np.size(key) == 0:
            # A slice or one document (the index checks, a first offset): no compiled call.
            sequence = np.asarray(self._documents[key], dtype=np.int64)
            starts = np.full(sequence.shape, self._total, dtype=np.int64)
            inside = sequence < len(self._pointers)
            starts[inside] = self._pointers[sequence[inside]] >> self._shift
            return int(starts) if starts.ndim == 0 else starts
        at = np.asarray(key, dtype=np.int64)
        flat = np.ascontiguousarray(at.ravel())
        if int(flat.min()) < 0 or int(flat.max()) >= len(self._documents):
            raise InternalError("Megatron offsets: a document index out of range (a bug)")
        out = np.empty(flat.shape, np.int64)
        document_token_starts(self._documents, self._pointers, self._shift, self._total, flat, out)
        return out.reshape(at.shape)


def _check_pointers(lengths: np.ndarray, pointers: np.ndarray, itemsize: int, where: str) -> int:
    """The token count of the .bin the index describes, after checking that sequences
    are laid out back to back from byte 0 (as Megatron writes them)."""
    end = 0
    for lo in range(0, len(lengths), _CHUNK):
        size = np.asarray(lengths[lo : lo + _CHUNK], dtype=np.int64)
        pointer = np.asarray(pointers[lo : lo + _CHUNK])
        if (size < 0).any():
            at = lo + int(np.flatnonzero(size < 0)[0])
            raise InvalidConfig(
                f"{where}: sequence {at} has length {int(size[at - lo])}; lengths must be >= 0"
            )
        expected = end + np.concatenate([[0], np.cumsum(size[:-1] * itemsize)])
        if (pointer != expected).any():
            at = int(np.flatnonzero(pointer != expected)[0])
            raise InvalidConfig(
                f"{where}: sequence {lo + at} starts at byte {int(pointer[at])}, expected "
                f"{int(expected[at])}; pointers must follow the lengths back to back "
                f"(the file is corrupt or not written by Megatron's builder)"
            )
        end = int(expected[-1] + size[-1] * itemsize)
    return end // itemsize


def open_megatron(prefix: CorpusPath, name: str) -> Part:
    """Memory-map ``PREFIX.idx`` and ``PREFIX.bin`` (a remote one: the index read
    whole, the tokens by range) and check them against each other."""
    idx_path = regular_file(prefix.with_name(prefix.name + ".idx"), "Megatron index")
    bin_path = regular_file(prefix.with_name(prefix.name + ".bin"), "Megatron data file")
    where = f"Megatron index {str(idx_path)!r}"
    index: np.ndarray
    if isinstance(idx_path, Url):
        index = np.frombuffer(read_bytes(idx_path, "Megatron index"), np.uint8)
    elif idx_path.stat().st_size:
        index = np.memmap(idx_path, np.uint8, "r")
    else:
        index = np.zeros(0, np.uint8)
    size = len(index)
    head = bytes(index[: _HEADER.size])
    if len(head) < _HEADER.size:
        raise InvalidConfig(
            f"{where} is truncated: {size} bytes, shorter than the {_HEADER.size}-byte header"
        )
    magic, version, code, sequences, document_count = _HEADER.unpack(head)
    if magic != MAGIC:
        raise InvalidConfig(
            f"{where} starts with {magic!r}; expected the magic {MAGIC!r} "
            f"of a Megatron indexed dataset"
        )
    if version != VERSION:
        raise InvalidConfig(f"{where} has version {version}; expected {VERSION}")
    if code not in DTYPES:
        raise InvalidConfig(
            f"{where} has dtype code {code}; expected one of "
            f"{sorted(DTYPES)} ({', '.join(d.__name__ for d in DTYPES.values())})"
        )
    dtype = np.dtype(DTYPES[code])
    if dtype.kind not in "iu":
        raise InvalidConfig(
            f"{where} holds {dtype} tokens (dtype code {code}); tokens must "
            f"be integers (codes 1-5 and 8)"
        )
    needed = _HEADER.size + 4 * sequences + 8 * sequences + 8 * document_count
    if size not in (needed, needed + sequences):  # + one mode byte per sequence
        raise InvalidConfig(
            f"{where} is {size} bytes; its header ({sequences} sequences, "
            f"{document_count} document indices) needs {needed}: the file is truncated or "
            f"corrupt"
        )
    if document_count < 1:
        raise InvalidConfig(f"{where}: the document index is empty; expected at least [0]")
    offset = _HEADER.size
    # Views of the index's bytes (a memory map stays one): no copy of the index.
    lengths = index[offset : offset + 4 * sequences].view(np.int32)
    offset += 4 * sequences
    pointers = index[offset : offset + 8 * sequences].view(np.int64)
    offset += 8 * sequences
    documents = index[offset : offset + 8 * document_count].view(np.int64)
    check_offsets(documents, sequences, f"{where}: document indices")
    total = _check_pointers(lengths, pointers, dtype.itemsize, where)
    data = RemoteFile(bin_path, "Megatron data file") if isinstance(bin_path, Url) else None
    bin_size = data.size if data is not None else os.stat(str(bin_path)).st_size
    if bin_size < total * dtype.itemsize:
        raise InvalidConfig(
            f"Megatron data file {str(bin_path)!r} is {bin_size} bytes; its index describes "
            f"{total} {dtype} tokens ({total * dtype.itemsize} bytes): the file is truncated"
        )
    tokens: Any
    if data is not None:
        tokens = RemoteArray(data, 0, dtype, total)
    elif total:
        tokens = np.memmap(str(bin_path), dtype, "r", 0, (total,))
    else:
        tokens = np.zeros(0, dtype)
    return Part(name, tokens, _DocumentOffsets(pointers, documents, dtype.itemsize, total))


class MegatronSource(OffsetsReader):
    """Megatron indexed datasets (``PREFIX.bin`` + ``PREFIX.idx``) in manifest order."""

    def __init__(self, prefixes: list[CorpusPath], names: list[str], binding: BindingSpec) -> None:
        super().__init__(
            [open_megatron(p, n) for p, n in zip(prefixes, names, strict=True)],
            binding,
            f"Megatron datasets {names}",
        )
