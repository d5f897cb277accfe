"""Shared helpers for packing tests: the worked example, and both packers under both
placement policies side by side."""

from __future__ import annotations

import dataclasses

import numpy as np
from hypothesis import strategies as st

import streampack as sp
from streampack.reference.packing import reference_pack

BINDING = sp.Binding(266, "fixture-bos0-eos1", "worked-example", "train")
A, B, C = [0, 99, 100, 1], [0, 101, 1], [0, 102, 103, 104, 1]


def compiled_pack(examples, binding, config):
    return sp.pack_examples(examples, binding, config).batches


#: Open rows of the best-fit packers: few, so that small cases reach the bound too.
BEST_FIT_OPEN_ROWS = 2


def with_policy(pack, policy: str):
    """``pack`` with the config's policy replaced by ``policy``."""
    open_rows = BEST_FIT_OPEN_ROWS if policy == "best_fit" else None

    def packed(examples, binding, config):
        return pack(
            examples, binding, dataclasses.replace(config, policy=policy, open_rows=open_rows)
        )

    packed.policy = policy
    return packed


#: Every implementation under every policy: the scenario suite runs against each.
PACKERS = {
    f"{name}-{policy}": with_policy(pack, policy)
    for policy in sp.PackConfig.POLICIES
    for name, pack in (("compiled", compiled_pack), ("reference", reference_pack))
}


#: Supervision masks for the worked example (rule C5), "prompt then response": the
#: pair predicting token t is trained where t's mask is 1. A trains 100 and EOS, B its
#: EOS, C 102, 104 and EOS. Each document's first mask value is never read.
MASK_A, MASK_B, MASK_C = [0, 0, 1, 1], [1, 0, 1], [0, 1, 0, 1, 1]
#: The worked example's loss_mask rows with those masks (capacity 6, next-fit).
MASKED_LOSS_ROWS = [
    [False, True, True, False, True, False],
    [True, False, True, True, False, False],
]


@st.composite
def random_packing_case(draw, with_mask: bool = False):
    """A random case for the packing properties, as ``(examples, binding, config)``: 1-8
    documents of 2-12 tokens over a vocabulary of 2-50 ids, up to 20 occurrences (any
    document, any range of two tokens or more, any of 100 sources), capacity 11-16 and
    1-4 rows a batch. ``with_mask`` adds a random 0/1 supervision mask, uint8 or bool."""
    vocab = draw(st.integers(2, 50))
    documents = draw(
        st.lists(
            st.lists(st.integers(0, vocab - 1), min_size=2, max_size=12), min_size=1, max_size=8
        )
    )
    count = draw(st.integers(0, 20))
    doc = draw(st.lists(st.integers(0, len(documents) - 1), min_size=count, max_size=count))
    start = [draw(st.integers(0, len(documents[d]) - 2)) for d in doc]
    stop = [draw(st.integers(s + 2, len(documents[d]))) for d, s in zip(doc, start)]
    mask = None
    if with_mask:
        tokens = sum(map(len, documents))
        bits = draw(st.lists(st.integers(0, 1), min_size=tokens, max_size=tokens))
        mask = np.array(bits).astype(draw(st.sampled_from([np.uint8, np.bool_])))
    examples = sp.Examples(
        tokens=np.concatenate(documents),
        offsets=np.concatenate([[0], np.cumsum([len(x) for x in documents])]),
        doc=doc,
        start=start,
        stop=stop,
        source_id=draw(st.lists(st.integers(0, 99), min_size=count, max_size=count)),
        mask=mask,
    )
    config = sp.PackConfig(
        capacity=draw(st.integers(11, 16)), max_rows_per_batch=draw(st.integers(1, 4))
    )
    return examples, sp.Binding(vocab, "t", "s", "train"), config
