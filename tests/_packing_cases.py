"""Shared helpers for packing tests: the worked example, and both packers under both
placement policies side by side."""

from __future__ import annotations

import dataclasses

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
