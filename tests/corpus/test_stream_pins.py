"""The stream, pinned across every format: windows byte-identical to the code before
block reading (commit b1359c1), in corpus order and shuffled, with and without masks,
long documents quarantined and split, bad documents included, and mixtures.

Each case writes the same documents (some out of vocabulary, too short or too long for
the capacity) with a format's own writer (``tests/_formats.py``) and digests every
field of every window of epoch 1 (``window_digest``)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
from _formats import (
    MASKED_WRITERS,
    WRITERS,
    documents,
    manifest,
    masks,
    write_jsonl,
    write_shards,
)

from streampack.corpus import open_corpus
from streampack.windows import CutSpec, iter_windows


def window_digest(path: Path, spec: CutSpec) -> str:
    """sha256 of every field of every window of epoch 1, in order (the mask too)."""
    h = hashlib.sha256()
    for w in iter_windows(open_corpus(path), 1, spec):
        fields = [
            w.epoch,
            w.index,
            w.documents,
            w.documents_split,
            w.pairs_cut,
            w.ranges_unsupervised,
            w.quarantined,
        ]
        h.update(json.dumps(fields, sort_keys=True).encode())
        for name, a in w.arrays().items():
            # The mask's, the source's and the piece starts' frames came after the pin:
            # hashed below (the source's as it was before it was a frame).
            if name not in ("mask", "source", "piece_start"):
                h.update(name.encode() + str(a.dtype).encode() + a.tobytes())
        h.update(w.source_index.tobytes())
        h.update(b"no mask" if w.mask is None else w.mask.tobytes())
        # A piece of a split document starts inside it (all 0 elsewhere, as before
        # piece starts existed: an unsplit window's digest is the one pinned then).
        if w.piece_start.any():
            h.update(b"piece_start" + w.piece_start.tobytes())
    return h.hexdigest()


def corpus_documents() -> list[list[int]]:
    """300 documents of 2..60 tokens with a few bad ones: out of vocabulary (512),
    too short; capacity 40 makes those over 41 tokens too long."""
    docs = documents(300, seed=3)
    docs[5][3] = 600
    docs[17] = [3]
    docs[140][0] = 511 + 9
    return docs


def corpus_masks(docs: list[list[int]]) -> list[list[int]]:
    """A prompt/completion mask per document, one unsupervised and one too short."""
    mask = masks([d if len(d) > 1 else [0, 0] for d in docs], seed=4)
    mask[17] = [1]
    mask[30] = [0] * len(docs[30])  # unsupervised
    return mask


def _with(path: Path, **extra: object) -> Path:
    data = json.loads((path / "manifest.json").read_text())
    data.update(extra)
    (path / "manifest.json").write_text(json.dumps(data))
    return path


def write_case(root: Path, case: str) -> Path:
    docs = corpus_documents()
    mask = corpus_masks(docs)
    if case == "shards":
        return write_shards(root, docs)
    if case == "jsonl":
        return write_jsonl(root, docs)
    if case in WRITERS:
        return WRITERS[case](root, docs)
    if case in MASKED_WRITERS:
        return MASKED_WRITERS[case](root, docs, mask)
    if case == "parquet_nulls":
        import pyarrow as pa
        import pyarrow.parquet as pq

        rows: list[list[int | None] | None] = [list(d) for d in docs]
        rows[9] = None
        rows[44] = [*docs[44][:3], None, *docs[44][4:]]
        rows[45] = []
        pq.write_table(
            pa.table({"input_ids": pa.array(rows, pa.list_(pa.int64()))}),
            root / "n.parquet",
            row_group_size=37,
        )
        return manifest(root, parquet=["n.parquet"])
    if case.startswith("mixture_"):
        first, second = case.removeprefix("mixture_").split("+")
        entries = []
        for k, name in enumerate((first, second)):
            sub = root / f"m{k}"
            sub.mkdir()
            data = json.loads((write_case(sub, name) / "manifest.json").read_text())
            entry = {
                key: value
                for key, value in data.items()
                if key not in ("format", "version", "binding")
            }
            for key in ("shards", "parquet", "jsonl", "arrow", "megatron"):
                if key in entry:
                    entry[key] = [f"m{k}/{n}" for n in entry[key]]
            entries.append({"weight": 2 - k, **entry})
        return manifest(root, sources=entries)
    raise AssertionError(case)


SPEC = {"capacity": 40, "window_documents": 23, "window_tokens": 700, "seed": 5}

# case -> digests: long documents quarantined (in order, shuffled), then split (in
# order, shuffled; a mixture's sources keep their own policy). Computed at b1359c1;
# the split ones again when windows gained each piece's start in its document (the
# other fields of those windows unchanged; these corpora's mixtures split nothing).
PINS: dict[str, tuple[str, str, str, str]] = {
    "shards": (
        "08f614029832db4eef3c6cf440b6227e44ba0ac05faae05972c76959ae8cb1a4",
        "bc395f4fd3688c71573c66377d07edb6ba57025deb6f1b3bc383601d589979cd",
        "463b49fbf3c63738d9c23de0772d1423f0a23a7f050c34ea2baa9e91503f3c92",
        "28d62a3c9588dff2b2be70aa720cbb8a7d600fa96e6f2c04de3681e05d585873",
    ),
    "jsonl": (
        "50024a737be6f1c0f911846a76cb269487066ad6b7b0a0e22df7a3eb612683a7",
        "1f100ddd5f0b4f0aa25eb7701a470c69c828935ea95145179b805432a794eb81",
        "e3e572dd714cd301d44361a1e56d366a91e542e14be50c3cb1f72ea3d3029002",
        "eb290b82be9b133a38245468af4241959cc7fadba1f11d6fdfd2886fac85bca8",
    ),
    "parquet": (
        "ef7c16e42f854b2eb95aa51f9f4f24238368266f7b4d5248406fd90f071ec017",
        "d26e314422ab696ef8faa20bd35b7a0eca0a340ecd18fdff290320a63a0da932",
        "7c060b9ed5aac01d28cebdf4f0f97d8c9d1ebe34edb38c28b6f037d7276ebaeb",
        "52158bac8b562d5cd6dfa8ff432327f5db40c6d4062256c2b4c7eddd434a8534",
    ),
    "hf_dataset": (
        "03dd8dcb2e2163d627b45655cc47483a7883debffc309ce808f485683d4c936d",
        "42d43be1e02a218d814211e8b1c9d28f654f054e76547e2a03229f4e64cd332d",
        "0611adea51a47bc0991c880162254cf88f1a8189b577b83fffc2ebdaf57b647f",
        "682a42fc5cf80cd95478dc837a2d663cfc948c14a3fed7aa5fb1fe173c017225",
    ),
    "arrow_file": (
        "07d732c44754d116c5b84b4ee3f795bb92e586360fe49a6eb8daf20af76fd346",
        "ac88ad7e7acc67844c7f7d5703e39e9e1bfeed102563d3fa39dee5e1d1c87a17",
        "bd57e540ddd22ea9cfc578c1684b1a867d9e2039c7d389d42f9868e47f644ac0",
        "5bb7b9c7425e0c87ad9d4cef78a2c72bce864586057ccb5e98c47de214bf47fc",
    ),
    "megatron": (
        "7dcc5ae79cf94cf9fb3f00d04da7c03f8cf54b6f3e1f4584835f2973b2cd8dff",
        "64c84c2bf1c2a011c460d78745328af4c658868fcdd3230fe6b602997d6353fe",
        "609ab94e276bcc3963b67fc8e2ddd2978c5ee07bbfae255286e63379685f2d65",
        "0219f868c9cb611ec34c8ecdcd5e2019c2ae9e4eba0913c3d22cb904d8964a1f",
    ),
    "shards_uint8": (
        "7290db128f657ce284db6c9e66d5eb660078120e27fa80fc79c1e951a1d5e9f1",
        "54082eaa1b3b40059e743eb32403a5308b270da9f3feb04b3e5d228dcdc5f423",
        "c27e0164e405eaff91383d0652d4e38bbaa6da6fb9936af659c575b1f7470f6b",
        "564e4347b5820d02ffea5534529e52fbeb93a58185752f4c3807ea68eb4695f6",
    ),
    "shards_bool": (
        "7290db128f657ce284db6c9e66d5eb660078120e27fa80fc79c1e951a1d5e9f1",
        "54082eaa1b3b40059e743eb32403a5308b270da9f3feb04b3e5d228dcdc5f423",
        "c27e0164e405eaff91383d0652d4e38bbaa6da6fb9936af659c575b1f7470f6b",
        "564e4347b5820d02ffea5534529e52fbeb93a58185752f4c3807ea68eb4695f6",
    ),
    "jsonl_mask": (
        "943356ae5a195bb1ca964e54263d9d87b96b0a282294641cd1ff783388fde33e",
        "938f1f4754630a59fc9cefc5a092298e864c807d36827f7f97d92ea756c3ccd5",
        "53122fc7861fcad582e11b4428d11d2d485e817508de6f6ac7077dce4531c2c8",
        "0b5811adc33826cfb5869fd4acb1477f6b351f2e3d5ae05c3922116b0fde7152",
    ),
    "jsonl_labels": (
        "943356ae5a195bb1ca964e54263d9d87b96b0a282294641cd1ff783388fde33e",
        "938f1f4754630a59fc9cefc5a092298e864c807d36827f7f97d92ea756c3ccd5",
        "53122fc7861fcad582e11b4428d11d2d485e817508de6f6ac7077dce4531c2c8",
        "0b5811adc33826cfb5869fd4acb1477f6b351f2e3d5ae05c3922116b0fde7152",
    ),
    "parquet_mask": (
        "e9a1ec5521e884e8843b4ece6bbedac647f1f1dfd2949bc1cb988766e7753709",
        "5785e09e0003e4380a7f063667457e8b642c0460629fcaf2b462af994e68d67a",
        "2901b9eb93515807ff1d764745a3e33a6c03b093295b576a5f04d0c98eca8309",
        "92b6d29db7764c2af9884be17f6a7e18842e0003ba38ec1a825931b686f1d479",
    ),
    "parquet_labels": (
        "e9a1ec5521e884e8843b4ece6bbedac647f1f1dfd2949bc1cb988766e7753709",
        "5785e09e0003e4380a7f063667457e8b642c0460629fcaf2b462af994e68d67a",
        "2901b9eb93515807ff1d764745a3e33a6c03b093295b576a5f04d0c98eca8309",
        "92b6d29db7764c2af9884be17f6a7e18842e0003ba38ec1a825931b686f1d479",
    ),
    "hf_dataset_mask": (
        "bb5ddf307cc4acf698ca2ae2e589d82052086d5b03652c257b38aa466f276bdb",
        "2c30ab6a751e1dea330df14002136bd5f1d424f1613ad5bd1ffa8472758ead89",
        "18f99ec95b93e663aa7a1b312b323fce0e91a7608b9fbee3d7602fb08f250536",
        "4daa24e571bb3e745786af6e2730e90a0fb0dc906aa32c9cf3855ea7721a4a03",
    ),
    "hf_dataset_labels": (
        "bb5ddf307cc4acf698ca2ae2e589d82052086d5b03652c257b38aa466f276bdb",
        "2c30ab6a751e1dea330df14002136bd5f1d424f1613ad5bd1ffa8472758ead89",
        "18f99ec95b93e663aa7a1b312b323fce0e91a7608b9fbee3d7602fb08f250536",
        "4daa24e571bb3e745786af6e2730e90a0fb0dc906aa32c9cf3855ea7721a4a03",
    ),
    "arrow_file_bool": (
        "a68e3c949f9ef0a7bdac4f132144c82705670b261f6c1e3773bf081b4c706491",
        "19b49a0d4bda1afe298effa69a87d63b0515351a9e47f19146b1e1cc1ecb1c9f",
        "b305a935636742cd20b85963a870dd10b35a57bb7c0d938e8c532d7e8384448c",
        "fd3864a171e6efdb35ad7fb2cd6af8b791992864f7df74341e9a3ced411093a0",
    ),
    "parquet_nulls": (
        "f4032968344c5b38756d298ef3e0ac023261c4d6a8b65bce835b077e0a299a95",
        "acf06a414fedafff553061c26cd90b69ab3e25a6ecdc0280fcdbae569d92d269",
        "bb6939a08cdbf78153552ee42653491ebd94c5f4434099c417175f05dc7c43ff",
        "53b00cdd1410bff88d539d22e7e191a7d6f8958d343be18360e0ac296ce7e39f",
    ),
    "mixture_parquet+shards": (
        "a034931ddec864dd4bf70e7e7edeba3901de946eebb6df0d19d3f2462570a3ff",
        "ebf8a9d3a8754f7460f0ac14eeb0656c0a822a41b9fc55ef0829cea30cd54134",
        "a034931ddec864dd4bf70e7e7edeba3901de946eebb6df0d19d3f2462570a3ff",
        "ebf8a9d3a8754f7460f0ac14eeb0656c0a822a41b9fc55ef0829cea30cd54134",
    ),
    "mixture_parquet_labels+jsonl": (
        "1fe16317868d05f65c85d49a7d60d1dedc622396acdc625f22af755d0ef57895",
        "1128e40e44416e4654a11c8946d3cb454e6b6cdb20c76ee70f99d85ff91a7fb9",
        "1fe16317868d05f65c85d49a7d60d1dedc622396acdc625f22af755d0ef57895",
        "1128e40e44416e4654a11c8946d3cb454e6b6cdb20c76ee70f99d85ff91a7fb9",
    ),
    "mixture_jsonl+parquet": (
        "f92632eda13d5b6eb353f30cb19b8241843945efda277e3329d1b2f5263689ed",
        "38ed55cde2090f07a6dcb8de8295d740f2b40bdddaf7e8448948776570f685c6",
        "f92632eda13d5b6eb353f30cb19b8241843945efda277e3329d1b2f5263689ed",
        "38ed55cde2090f07a6dcb8de8295d740f2b40bdddaf7e8448948776570f685c6",
    ),
}


def _all_cases() -> list[str]:
    return [
        "shards",
        "jsonl",
        *WRITERS,
        *MASKED_WRITERS,
        "parquet_nulls",
        "mixture_parquet+shards",
        "mixture_parquet_labels+jsonl",
        "mixture_jsonl+parquet",
    ]


def digests(root: Path, case: str) -> tuple[str, str, str, str]:
    out = []
    for split in (False, True):
        here = root / f"{case}-{split}"
        here.mkdir()
        path = write_case(here, case)
        if split and not case.startswith("mixture_"):
            _with(path, long_documents="split")
        for shuffle in (False, True):
            spec = CutSpec(shuffle=shuffle, shuffle_buffer=50, **SPEC)
            out.append(window_digest(path, spec))
    return tuple(out)  # type: ignore[return-value]


@pytest.mark.parametrize("case", _all_cases())
def test_windows_are_byte_identical_across_formats(tmp_path, case):
    assert digests(tmp_path, case) == PINS[case]


@pytest.mark.parametrize("case", ["parquet", "parquet_labels", "jsonl_mask", "parquet_nulls"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_a_resumed_sequential_epoch_is_the_tail_of_the_whole_one(tmp_path, case, shuffle):
    """``start_window`` (a producer resuming): the blocks before it are cut and
    shuffled but not screened, and the windows after it are those of the whole epoch."""
    path = write_case(tmp_path, case)
    spec = CutSpec(shuffle=shuffle, shuffle_buffer=50, **SPEC)
    full = list(iter_windows(open_corpus(path), 1, spec))
    tail = list(iter_windows(open_corpus(path), 1, spec, start_window=5))
    assert len(full) > 8 and [w.index for w in tail] == [w.index for w in full[5:]]
    for a, b in zip(full[5:], tail, strict=True):
        assert a.quarantined == b.quarantined
        for name, array in a.arrays().items():
            np.testing.assert_array_equal(array, b.arrays()[name])
