"""Small corpora written with each format's own library (or, for Megatron, byte for
byte by its documented index layout), for the reader tests."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np

BINDING = {"vocab_size": 512, "tokenizer": "t", "split_receipt": "r", "partition": "train"}
MEGATRON_CODES = {
    np.uint8: 1,
    np.int8: 2,
    np.int16: 3,
    np.int32: 4,
    np.int64: 5,
    np.float64: 6,
    np.float32: 7,
    np.uint16: 8,
}


def documents(count: int = 70, seed: int = 0) -> list[list[int]]:
    """Documents of 2..60 tokens with ids in 0..511, each one different."""
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 512, int(rng.integers(2, 61))).tolist() for _ in range(count)]


def manifest(root: Path, **entry: object) -> Path:
    (root / "manifest.json").write_text(
        json.dumps({"format": "streampack-corpus", "version": 1, "binding": BINDING, **entry})
    )
    return root


def write_parquet(
    root: Path,
    docs: list[list[int]],
    *,
    row_group_size: int = 16,
    column: str = "input_ids",
    files: int = 2,
) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    names = []
    for index, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        table = pa.table(
            {
                column: pa.array([docs[i] for i in part], pa.list_(pa.int32())),
                "text": [f"doc {i}" for i in part],
            }
        )
        name = f"train-{index:03d}.parquet"
        pq.write_table(table, root / name, row_group_size=row_group_size)
        names.append(name)
    extra = {} if column == "input_ids" else {"column": column}
    return manifest(root, parquet=names, **extra)


def write_hf_dataset(root: Path, docs: list[list[int]], *, shards: int = 2) -> Path:
    """``datasets.Dataset.save_to_disk`` (batches of 16 rows, ``shards`` data files)."""
    import datasets

    dataset = datasets.Dataset.from_dict(
        {"input_ids": docs, "text": [str(i) for i in range(len(docs))]}
    )
    dataset.save_to_disk(str(root / "hf"), num_shards=shards)
    return manifest(root, arrow=["hf"])


def write_arrow_file(root: Path, docs: list[list[int]]) -> Path:
    """An Arrow IPC *file* (not stream) with record batches of 16 rows, uint16 tokens."""
    import pyarrow as pa

    schema = pa.schema([("input_ids", pa.list_(pa.uint16()))])
    with pa.OSFile(str(root / "docs.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for lo in range(0, len(docs), 16):
            writer.write_batch(
                pa.record_batch(
                    [pa.array(docs[lo : lo + 16], pa.list_(pa.uint16()))], schema=schema
                )
            )
    return manifest(root, arrow=["docs.arrow"])


def megatron_index(
    sequence_lengths: list[int],
    document_indices: list[int],
    dtype: type = np.uint16,
    *,
    version: int = 1,
    code: int | None = None,
) -> bytes:
    """A Megatron ``.idx`` file, field by field as Megatron's index writer lays it out."""
    itemsize = np.dtype(dtype).itemsize
    pointers = np.cumsum([0, *sequence_lengths])[:-1] * itemsize
    return b"".join(
        [
            b"MMIDIDX\x00\x00",
            struct.pack("<Q", version),
            struct.pack("<B", MEGATRON_CODES[dtype] if code is None else code),
            struct.pack("<Q", len(sequence_lengths)),
            struct.pack("<Q", len(document_indices)),
            np.asarray(sequence_lengths, dtype=np.int32).tobytes(),
            np.asarray(pointers, dtype=np.int64).tobytes(),
            np.asarray(document_indices, dtype=np.int64).tobytes(),
        ]
    )


def write_megatron(
    root: Path, docs: list[list[int]], dtype: type = np.uint16, prefix: str = "corpus_text_document"
) -> Path:
    """One sequence per document (how GPT data is prepared), in two prefixes."""
    names = []
    for index, part in enumerate(np.array_split(np.arange(len(docs)), 2)):
        name = f"{prefix}_{index}"
        chosen = [docs[i] for i in part]
        (root / f"{name}.bin").write_bytes(np.concatenate(chosen).astype(dtype).tobytes())
        (root / f"{name}.idx").write_bytes(
            megatron_index([len(d) for d in chosen], list(range(len(chosen) + 1)), dtype)
        )
        names.append(name)
    return manifest(root, megatron=names)


WRITERS = {
    "parquet": write_parquet,
    "hf_dataset": write_hf_dataset,
    "arrow_file": write_arrow_file,
    "megatron": write_megatron,
}


def write_masked_shards(
    root: Path, docs: list[list[int]], masks: list[list[int]], *, shards: int = 2
) -> Path:
    """Token shards (``NAME.tokens.npy`` uint16, ``NAME.offsets.npy`` int64) with each
    document's supervision mask beside them (``NAME.mask.npy``, uint8, one 0/1 per token)."""
    names = []
    for index, part in enumerate(np.array_split(np.arange(len(docs)), shards)):
        name = f"shard-{index:03d}"
        chosen = [docs[i] for i in part]
        np.save(root / f"{name}.tokens.npy", np.concatenate(chosen).astype(np.uint16))
        np.save(root / f"{name}.offsets.npy", np.cumsum([0, *map(len, chosen)]).astype(np.int64))
        np.save(
            root / f"{name}.mask.npy", np.concatenate([masks[i] for i in part]).astype(np.uint8)
        )
        names.append(name)
    return manifest(root, shards=names)


def prompt_response_masks(docs: list[list[int]], seed: int = 0) -> list[list[int]]:
    """A mask per document as chat data has one: a prompt (0s) of a random length, then
    the response (1s), at least one supervised token."""
    rng = np.random.default_rng(seed)
    out = []
    for doc in docs:
        prompt = int(rng.integers(1, len(doc)))
        out.append([0] * prompt + [1] * (len(doc) - prompt))
    return out
