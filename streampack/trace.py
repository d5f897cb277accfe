"""``streampack trace``: the worked example, packed and explained, as JSON.

The fixture (``fixtures/seed/input.json``) names the documents, the binding, the pack
config and the probe's gold probability per document; ``expected.json`` beside it is
the golden output this command must reproduce.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import numpy as np

from .auditing import compare_executions
from .batch import PackedBatch
from .config import PackConfig
from .decoder import Decoder, DecoderConfig
from .errors import InvalidConfig
from .examples import Binding, Examples
from .loss import document_mean, probe_logits, row_mean, token_loss
from .packing import pack_examples

#: Where the worked example is looked for when --fixture is not given: the source
#: tree, then the data files a wheel installs.
DEFAULT_FIXTURE_DIRS = (
    Path(__file__).resolve().parents[1] / "fixtures" / "seed",
    Path(sys.prefix) / "share" / "streampack" / "seed",
)

LOSS_DECIMALS = 6


# --- the decoder section: packed, padded and separate runs compared ------------------

TRACE_DECIMALS = 6
DIFF_DECIMALS = 12


def decoder_trace(
    examples: Examples,
    batch: PackedBatch,
    *,
    config: DecoderConfig | None = None,
    seed: int = 42,
) -> dict[str, Any]:
    """The ``decoder`` section of ``streampack trace`` for one packed batch.

    Runs the large profile (seed 42) separately, padded and packed over the batch's
    occurrences and reports the three loss sums, how many values each comparison
    checked, the largest differences (rounded to 12 decimals, as the exact figures
    depend on the BLAS summation order) and the attention bookkeeping: storage cells,
    dense score positions per head, permitted edges and the share of valid cells.
    """
    config = config or DecoderConfig.large(vocab_size=int(batch.binding.vocab_size))
    decoder = Decoder.init(config, seed)
    result = compare_executions(decoder, examples, batch)
    sums = result.loss_sums
    vs_packed = result.packed_vs_separate
    vs_padded = result.padded_vs_separate
    stats = batch.stats()
    comparisons = [vs_packed, vs_padded]
    return {
        "profile": {
            "vocab_size": config.vocab_size,
            "width": config.width,
            "heads": config.heads,
            "ff_width": config.ff_width,
            "layers": config.layers,
            "max_positions": config.max_positions,
            "parameters": config.parameter_count(),
            "seed": seed,
        },
        "loss_sums": {name: round(value, TRACE_DECIMALS) for name, value in sums.items()},
        "targets": int(np.count_nonzero(batch.loss_mask)),
        "comparisons": {
            "logits_per_comparison": vs_packed.logits,
            "gradient_coordinates_per_comparison": vs_packed.gradient_coordinates,
            "logits_total": sum(c.logits for c in comparisons),
            "gradient_coordinates_total": sum(c.gradient_coordinates for c in comparisons),
        },
        "max_abs_diff": {
            name: {
                "logits": round(c.max_logit_diff, DIFF_DECIMALS),
                "loss": round(c.max_loss_diff, DIFF_DECIMALS),
                "gradients": round(c.max_grad_diff, DIFF_DECIMALS),
            }
            for name, c in (("packed_vs_separate", vs_packed), ("padded_vs_separate", vs_padded))
        },
        "passed": all(c.passed for c in comparisons),
        "attention_counts": {
            "cells": stats["cells"],
            "valid_cells": stats["valid_cells"],
            "dense_score_positions_per_head": stats["dense_score_positions"],
            "permitted_edges": stats["permitted_edges"],
            "valid_density": round(stats["valid_density"], TRACE_DECIMALS),
            "edge_density": round(stats["edge_density"], TRACE_DECIMALS),
        },
    }


def find_fixture(path: str | None) -> Path:
    candidates = [Path(path)] if path else [d / "input.json" for d in DEFAULT_FIXTURE_DIRS]
    for candidate in candidates:
        if candidate.is_dir():
            candidate = candidate / "input.json"
        if candidate.is_file():
            return candidate
    raise InvalidConfig(
        f"worked-example fixture not found at {', '.join(map(str, candidates))}; "
        "pass --fixture PATH to an input.json"
    )


def load_worked_example(path: Path) -> tuple[Examples, Binding, PackConfig, dict[str, Any]]:
    fixture = json.loads(path.read_text())
    names = list(fixture["documents"])
    examples = Examples.from_documents([fixture["documents"][n] for n in names])
    binding = Binding(**fixture["binding"])
    config = PackConfig(**fixture["config"])
    return examples, binding, config, fixture


def _row(batch: PackedBatch, r: int) -> dict[str, Any]:
    row = {name: getattr(batch, name)[r].tolist() for name in batch.ARRAY_FIELDS[:-1]}
    row["valid_length"] = int(batch.valid_lengths[r])
    return row


def trace(path: Path) -> dict[str, Any]:
    """Pack the fixture and describe every field, permission and loss figure."""
    examples, binding, config, fixture = load_worked_example(path)
    epoch = pack_examples(examples, binding, config)
    if len(epoch.batches) != 1:
        raise InvalidConfig(
            f"the trace describes one batch, but this fixture packs into {len(epoch.batches)}; "
            "raise config.max_rows_per_batch in the fixture"
        )
    batch = epoch.batches[0]
    names = list(fixture["documents"])
    # Segment s is document names[s] here: one example per document, in order.
    q_of_segment = np.array([fixture["probe_gold_probability"][n] for n in names])
    logits = probe_logits(batch, q_of_segment[np.maximum(batch.segments, 0)])
    loss = token_loss(logits, batch)
    stats = batch.stats()
    return {
        "binding": binding.as_dict(),
        "config": {"capacity": config.capacity, "max_rows_per_batch": config.max_rows_per_batch},
        "rows": [_row(batch, r) for r in range(batch.rows)],
        "occurrences": [
            {field: int(record[field]) for field in record.dtype.names}
            | {"document": names[int(examples.doc[record["ordinal"]])]}
            for record in batch.occurrences
        ],
        "allowed_keys": [
            {str(q): list(range(*batch.key_range(r, q))) for q in range(batch.valid_lengths[r])}
            for r in range(batch.rows)
        ],
        "valid_targets": loss.count,
        "loss": {
            "sum": round(loss.sum, LOSS_DECIMALS),
            "mean": round(loss.mean, LOSS_DECIMALS),
            "row_mean": round(row_mean(logits, batch), LOSS_DECIMALS),
            "document_mean": round(document_mean(logits, batch), LOSS_DECIMALS),
            "tolerance": fixture["loss_tolerance"],
        },
        "stats": stats
        | {
            "padding_fraction": round(stats["padding_fraction"], LOSS_DECIMALS),
            "valid_density": round(stats["valid_density"], LOSS_DECIMALS),
            "edge_density": round(stats["edge_density"], LOSS_DECIMALS),
        },
        "decoder": decoder_trace(examples, batch),
    }


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--fixture",
        default=None,
        help="worked-example input.json (default: fixtures/seed/input.json)",
    )


def main(args: argparse.Namespace) -> int:
    print(json.dumps(trace(find_fixture(args.fixture)), indent=2))
    return 0
