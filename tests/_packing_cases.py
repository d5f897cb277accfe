"""Shared helpers for packing tests: the worked example and both packers side by side."""

from __future__ import annotations

import streampack as sp
from streampack.reference.packing import reference_pack

BINDING = sp.Binding(266, "fixture-bos0-eos1", "worked-example", "train")
A, B, C = [0, 99, 100, 1], [0, 101, 1], [0, 102, 103, 104, 1]


def compiled_pack(examples, binding, config):
    return sp.pack_examples(examples, binding, config).batches


PACKERS = {"compiled": compiled_pack, "reference": reference_pack}
