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
