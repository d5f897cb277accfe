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
            if name != "mask":  # the mask's wire frame came after the pin; hashed below
                h.update(name.encode() + str(a.dtype).encode() + a.tobytes())
        h.update(w.source_index.tobytes())
        h.update(b"no mask" if w.mask is None else w.mask.tobytes())
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
# order, shuffled; a mixture's sources keep their own policy). Computed at b1359c1.
PINS: dict[str, tuple[str, str, str, str]] = {
    "shards": (
        "08f614029832db4eef3c6cf440b6227e44ba0ac05faae05972c76959ae8cb1a4",
        "bc395f4fd3688c71573c66377d07edb6ba57025deb6f1b3bc383601d589979cd",
        "6b34db549e81756abb47e1da316ac7014e28954170b34d4813c253c3f7772d32",
        "bef36883fee083310ec1b4bbdecc160ace5fede441886207c854b3e8f17dbccc",
    ),
    "jsonl": (
        "50024a737be6f1c0f911846a76cb269487066ad6b7b0a0e22df7a3eb612683a7",
        "1f100ddd5f0b4f0aa25eb7701a470c69c828935ea95145179b805432a794eb81",
        "5331c9c7d25d36bb4f6cca1f35453661c66389402fefe61ced8bd83e5bd1dc95",
        "52caafeb10369ae5ed546d270efaa39d7b91d5133d21153ee9dc05ad777dcdc9",
    ),
    "parquet": (
        "ef7c16e42f854b2eb95aa51f9f4f24238368266f7b4d5248406fd90f071ec017",
        "d26e314422ab696ef8faa20bd35b7a0eca0a340ecd18fdff290320a63a0da932",
        "5dc40edd36bef96f082f6929be9dd89d7a28014c7442c1d113fb52e87fbb8cb1",
        "a1b6f3b04f2934c071df6307455ab48cfdcda4b9fd51fecb54aaec37793e1394",
    ),
    "hf_dataset": (
        "03dd8dcb2e2163d627b45655cc47483a7883debffc309ce808f485683d4c936d",
        "42d43be1e02a218d814211e8b1c9d28f654f054e76547e2a03229f4e64cd332d",
        "f29a40fbe2dc8a11aea847bd3f6aca4871bf5770a44d0c85916daa082e506740",
        "ab73ea0bedd152a043a8ecf57dc85150d8db88f9666ddfd45527fcd48b1d9669",
    ),
    "arrow_file": (
        "07d732c44754d116c5b84b4ee3f795bb92e586360fe49a6eb8daf20af76fd346",
        "ac88ad7e7acc67844c7f7d5703e39e9e1bfeed102563d3fa39dee5e1d1c87a17",
        "6a655944242051802c8527fd7b9c1ba75fdec581a9f24f3629095f20a2ca902f",
        "8f28977fb0b1a3a03aec1dfa92f5cd14c4fe52b8c51558d73021a70f6f7e5c5b",
    ),
    "megatron": (
        "7dcc5ae79cf94cf9fb3f00d04da7c03f8cf54b6f3e1f4584835f2973b2cd8dff",
        "64c84c2bf1c2a011c460d78745328af4c658868fcdd3230fe6b602997d6353fe",
        "de0247609e556f77f50d31c1e5d1bc03f761182f18eaf250da01bccc8a8a537a",
        "2815a2be7d6ee008c8e0063a38e883304bd40d1f8419b65c99de01243200b392",
    ),
    "shards_uint8": (
        "7290db128f657ce284db6c9e66d5eb660078120e27fa80fc79c1e951a1d5e9f1",
        "54082eaa1b3b40059e743eb32403a5308b270da9f3feb04b3e5d228dcdc5f423",
        "ee4ba922af193739c0df83a371f27b3859032f754fa4dc926756700add0808e0",
        "d41e3c23d217173f43660dab21eb3cc70a046a75fb41ef2591ef99e90fff0203",
    ),
    "shards_bool": (
        "7290db128f657ce284db6c9e66d5eb660078120e27fa80fc79c1e951a1d5e9f1",
        "54082eaa1b3b40059e743eb32403a5308b270da9f3feb04b3e5d228dcdc5f423",
        "ee4ba922af193739c0df83a371f27b3859032f754fa4dc926756700add0808e0",
        "d41e3c23d217173f43660dab21eb3cc70a046a75fb41ef2591ef99e90fff0203",
    ),
    "jsonl_mask": (
        "943356ae5a195bb1ca964e54263d9d87b96b0a282294641cd1ff783388fde33e",
        "938f1f4754630a59fc9cefc5a092298e864c807d36827f7f97d92ea756c3ccd5",
        "09e391d8c659d374393424f60ec4588dc5de8bda634d11a5f0bc2b98b6e4f3e5",
        "6408a9d6d7b4170fee2658c2a42c5299cae9d292a41dd6c6fb1cbfb7430d02ea",
    ),
    "jsonl_labels": (
        "943356ae5a195bb1ca964e54263d9d87b96b0a282294641cd1ff783388fde33e",
        "938f1f4754630a59fc9cefc5a092298e864c807d36827f7f97d92ea756c3ccd5",
        "09e391d8c659d374393424f60ec4588dc5de8bda634d11a5f0bc2b98b6e4f3e5",
        "6408a9d6d7b4170fee2658c2a42c5299cae9d292a41dd6c6fb1cbfb7430d02ea",
    ),
    "parquet_mask": (
        "e9a1ec5521e884e8843b4ece6bbedac647f1f1dfd2949bc1cb988766e7753709",
        "5785e09e0003e4380a7f063667457e8b642c0460629fcaf2b462af994e68d67a",
        "ea47c9aae3d096c0ec30ba574c3444e900d10aa683936532516830ca718eb959",
        "2b34dfc46e9bca401e66d9cf7eedcccb861917b03c04a268ba7e5446c6be4904",
    ),
    "parquet_labels": (
        "e9a1ec5521e884e8843b4ece6bbedac647f1f1dfd2949bc1cb988766e7753709",
        "5785e09e0003e4380a7f063667457e8b642c0460629fcaf2b462af994e68d67a",
        "ea47c9aae3d096c0ec30ba574c3444e900d10aa683936532516830ca718eb959",
        "2b34dfc46e9bca401e66d9cf7eedcccb861917b03c04a268ba7e5446c6be4904",
    ),
    "hf_dataset_mask": (
        "bb5ddf307cc4acf698ca2ae2e589d82052086d5b03652c257b38aa466f276bdb",
        "2c30ab6a751e1dea330df14002136bd5f1d424f1613ad5bd1ffa8472758ead89",
        "cad0d9fadaad0c3284063949a42f17dfac1c51d2186b3e698f36c78d2cdd669b",
        "77535021fdaea143235d40c0ddd27343487fd31b997be9064bbb840c8ec163dd",
    ),
    "hf_dataset_labels": (
        "bb5ddf307cc4acf698ca2ae2e589d82052086d5b03652c257b38aa466f276bdb",
        "2c30ab6a751e1dea330df14002136bd5f1d424f1613ad5bd1ffa8472758ead89",
        "cad0d9fadaad0c3284063949a42f17dfac1c51d2186b3e698f36c78d2cdd669b",
        "77535021fdaea143235d40c0ddd27343487fd31b997be9064bbb840c8ec163dd",
    ),
    "arrow_file_bool": (
        "a68e3c949f9ef0a7bdac4f132144c82705670b261f6c1e3773bf081b4c706491",
        "19b49a0d4bda1afe298effa69a87d63b0515351a9e47f19146b1e1cc1ecb1c9f",
        "14b5bf6db22aa0fc33f977fefc16f6df91de490b72d7078f87d1a8fd430c4661",
        "821caa5fc5348693549066ffb67d82d67e7a0bb6c7915aa81f44610e3a52edab",
    ),
    "parquet_nulls": (
        "f4032968344c5b38756d298ef3e0ac023261c4d6a8b65bce835b077e0a299a95",
        "acf06a414fedafff553061c26cd90b69ab3e25a6ecdc0280fcdbae569d92d269",
        "454f0d504b69e92d205675aa7a956822dfed4ef7989d532aad1eb849aeb4f11d",
        "67c7dcbfe5f9511d19aaaa833cf084f88ecfc76a362ecf7eb8bfb1df3286c373",
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
