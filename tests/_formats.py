"""Small corpora written with each format's own library (or, for Megatron, byte for
byte by its documented index layout), for the reader tests; ``MASKED_WRITERS`` write
the same documents with a supervision mask, in each way a format can hold one."""

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


def masks(docs: list[list[int]], seed: int = 1) -> list[list[int]]:
    """A prompt/completion mask per document: 0 for a prompt of 1 .. len - 1 tokens,
    then 1 (so each document has at least one supervised target)."""
    rng = np.random.default_rng(seed)
    out = []
    for doc in docs:
        prompt = int(rng.integers(1, len(doc)))
        out.append([0] * prompt + [1] * (len(doc) - prompt))
    return out


def labels(docs: list[list[int]], mask: list[list[int]]) -> list[list[int]]:
    """Hugging Face labels: the token where the mask is 1, else -100."""
    return [[t if m else -100 for t, m in zip(d, k, strict=True)] for d, k in zip(docs, mask)]


def manifest(root: Path, **entry: object) -> Path:
    """``root/manifest.json`` holding ``corpus_manifest(**entry)``; returns ``root``."""
    (root / "manifest.json").write_text(json.dumps(corpus_manifest(**entry)))
    return root


def write_parquet(
    root: Path,
    docs: list[list[int]],
    *,
    row_group_size: int = 16,
    column: str = "input_ids",
    files: int = 2,
    supervision: dict[str, list[list[int]]] | None = None,
    key: str = "mask",
) -> Path:
    """Parquet files; ``supervision`` adds list<int8> columns by name (a mask, or
    list<int64> labels), and the manifest names the first under ``key``."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    supervision = supervision or {}
    names = []
    for index, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        columns = {
            column: pa.array([docs[i] for i in part], pa.list_(pa.int32())),
            "text": [f"doc {i}" for i in part],
        }
        for name, values in supervision.items():
            kind = pa.int64() if key == "labels" else pa.int8()
            columns[name] = pa.array([values[i] for i in part], pa.list_(kind))
        name = f"train-{index:03d}.parquet"
        pq.write_table(pa.table(columns), root / name, row_group_size=row_group_size)
        names.append(name)
    extra: dict[str, object] = {} if column == "input_ids" else {"column": column}
    if supervision:
        extra[key] = next(iter(supervision))
    return manifest(root, parquet=names, **extra)


def write_hf_dataset(
    root: Path,
    docs: list[list[int]],
    *,
    shards: int = 2,
    supervision: dict[str, list[list[int]]] | None = None,
    key: str = "mask",
) -> Path:
    """``datasets.Dataset.save_to_disk`` (batches of 16 rows, ``shards`` data files);
    ``supervision`` adds columns as TRL leaves them (``completion_mask``, ``labels``)."""
    import datasets

    dataset = datasets.Dataset.from_dict(
        {"input_ids": docs, "text": [str(i) for i in range(len(docs))], **(supervision or {})}
    )
    dataset.save_to_disk(str(root / "hf"), num_shards=shards)
    extra = {key: next(iter(supervision))} if supervision else {}
    return manifest(root, arrow=["hf"], **extra)


def write_arrow_file(
    root: Path, docs: list[list[int]], *, supervision: list[list[int]] | None = None
) -> Path:
    """An Arrow IPC *file* (not stream) with record batches of 16 rows, uint16 tokens;
    ``supervision`` adds a list<bool> ``assistant_masks`` column."""
    import pyarrow as pa

    fields = [("input_ids", pa.list_(pa.uint16()))]
    if supervision is not None:
        fields.append(("assistant_masks", pa.list_(pa.bool_())))
    schema = pa.schema(fields)
    with pa.OSFile(str(root / "docs.arrow"), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
        for lo in range(0, len(docs), 16):
            arrays = [pa.array(docs[lo : lo + 16], pa.list_(pa.uint16()))]
            if supervision is not None:
                bools = [[bool(v) for v in m] for m in supervision[lo : lo + 16]]
                arrays.append(pa.array(bools, pa.list_(pa.bool_())))
            writer.write_batch(pa.record_batch(arrays, schema=schema))
    extra = {} if supervision is None else {"mask": "assistant_masks"}
    return manifest(root, arrow=["docs.arrow"], **extra)


def write_shards(
    root: Path,
    docs: list[list[int]],
    *,
    supervision: list[list[int]] | None = None,
    mask_dtype: type = np.uint8,
    files: int = 2,
) -> Path:
    """Token shards (uint16), with ``NAME.mask.npy`` files when ``supervision`` is given
    (the manifest does not say: the files do)."""
    names = []
    for index, part in enumerate(np.array_split(np.arange(len(docs)), files)):
        name = f"shard-{index:03d}"
        write_shard(root, name, [docs[i] for i in part], np.uint16)
        if supervision is not None:
            mask = np.concatenate([supervision[i] for i in part]).astype(mask_dtype)
            np.save(root / f"{name}.mask.npy", mask)
        names.append(name)
    return manifest(root, shards=names)


def write_jsonl(
    root: Path,
    docs: list[list[int]],
    *,
    supervision: list[list[int]] | None = None,
    key: str = "mask",
) -> Path:
    """One ``{"tokens": ...}`` line per document, with the supervision under ``key``
    (``mask`` or ``labels``), named in the manifest."""
    lines = []
    for i, doc in enumerate(docs):
        line: dict[str, object] = {"tokens": doc}
        if supervision is not None:
            line[key] = supervision[i]
        lines.append(json.dumps(line))
    (root / "docs.jsonl").write_text("\n".join(lines) + "\n")
    extra = {} if supervision is None else {key: key}
    return manifest(root, jsonl=["docs.jsonl"], **extra)


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


def _labelled(writer, key="labels", name="labels"):
    def write(root: Path, docs: list[list[int]], mask: list[list[int]]) -> Path:
        return writer(root, docs, supervision={name: labels(docs, mask)}, key=key)

    return write


#: Each way a format holds a supervision mask: ``writer(root, docs, mask) -> corpus``.
MASKED_WRITERS = {
    "shards_uint8": lambda root, docs, mask: write_shards(root, docs, supervision=mask),
    "shards_bool": lambda root, docs, mask: write_shards(
        root, docs, supervision=mask, mask_dtype=np.bool_
    ),
    "jsonl_mask": lambda root, docs, mask: write_jsonl(root, docs, supervision=mask),
    "jsonl_labels": lambda root, docs, mask: write_jsonl(
        root, docs, supervision=labels(docs, mask), key="labels"
    ),
    "parquet_mask": lambda root, docs, mask: write_parquet(
        root, docs, supervision={"completion_mask": mask}
    ),
    "parquet_labels": _labelled(write_parquet),
    "hf_dataset_mask": lambda root, docs, mask: write_hf_dataset(
        root, docs, supervision={"completion_mask": mask}
    ),
    "hf_dataset_labels": _labelled(write_hf_dataset),
    "arrow_file_bool": lambda root, docs, mask: write_arrow_file(root, docs, supervision=mask),
}


# Token shards (the format most tests use) and the manifest every corpus has.


def corpus_manifest(**entry: object) -> dict:
    """A manifest: the format's header, ``BINDING`` (unless ``binding=`` is given), ``entry``."""
    return {"format": "streampack-corpus", "version": 1, "binding": BINDING, **entry}


def write_shard(root: Path, name: str, docs: list, dtype: type = np.int32) -> str:
    """Token shard ``name``: ``name.tokens.npy`` (the documents concatenated, as
    ``dtype``) and ``name.offsets.npy`` (their int64 bounds). Returns ``name``."""
    tokens = np.concatenate([np.asarray(d) for d in docs]) if docs else np.zeros(0)
    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    np.save(root / f"{name}.tokens.npy", tokens.astype(dtype))
    np.save(root / f"{name}.offsets.npy", offsets)
    return name
