"""``streampack corpus inspect``: what a corpus holds, for every supported format.

Reads the corpus through the same window cut and screen the service uses, so the
problems it reports are the documents the service would quarantine, and the fill is
what next-fit (rule C2) reaches at the given capacity over the surviving documents in
corpus order.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np

from streampack.corpus.manifest import open_corpus
from streampack.windows import CutSpec, Window, iter_windows

QUANTILES = (0.0, 0.5, 0.9, 0.99, 1.0)


@dataclasses.dataclass
class CorpusReport:
    path: str
    reader: str
    random_access: bool
    documents: int  # every document, quarantined ones included
    kept: int  # documents the screen keeps (the service trains on these)
    tokens: int  # tokens of the kept documents
    length_quantiles: dict[str, int]  # kept documents' lengths: min, p50, p90, p99, max
    capacity: int
    rows: int  # next-fit rows of `capacity` pairs the surviving documents fill
    fill: float  # real pairs / (rows * capacity)
    quarantined: dict[str, int]  # reason -> documents
    examples: list[dict[str, Any]]  # the first few quarantined documents, as logged
    binding: dict[str, Any]
    # A masked corpus: the kept ranges' targets that its mask marks (rule C5), and the
    # ranges of split documents dropped for having none; None without masks.
    supervised: int | None = None
    ranges_unsupervised: int = 0
    targets: int = 0  # prediction pairs of the kept ranges

    def text(self) -> str:
        q = self.length_quantiles
        lines = [
            f"corpus      {self.path}  ({self.reader}, "
            f"{'random access' if self.random_access else 'sequential'})",
            "binding     " + ", ".join(f"{k}={v}" for k, v in self.binding.items()),
            f"documents   {self.documents} ({self.kept} kept)",
            f"tokens      {self.tokens} (kept documents)",
            "lengths     " + "  ".join(f"{k} {v}" for k, v in q.items()),
            f"next-fit    capacity {self.capacity}: {self.rows} rows, fill {self.fill:.4f}",
        ]
        if self.supervised is not None:
            lines.append(
                f"supervised  {self.supervised} of {self.targets} targets"
                + (
                    f" ({self.ranges_unsupervised} split ranges with none dropped)"
                    if self.ranges_unsupervised
                    else ""
                )
            )
        if self.quarantined:
            lines.append(
                "problems    "
                + ", ".join(f"{n} {reason}" for reason, n in sorted(self.quarantined.items()))
            )
            lines += [f"  {e['location']}: {e['reason']}: {e['detail']}" for e in self.examples]
        else:
            lines.append("problems    none")
        return "\n".join(lines)


def _next_fit_rows(pairs: np.ndarray, capacity: int) -> int:
    """Rows next-fit opens placing examples of ``pairs`` pairs, in order."""
    rows, used = 0, capacity
    for n in pairs.tolist():
        if used + n > capacity:
            rows, used = rows + 1, 0
        used += n
    return rows


def inspect_corpus(
    path: str | Path, *, capacity: int = 2048, allow_outside: bool = False, examples: int = 5
) -> CorpusReport:
    """Read the whole corpus once (one window of tokens at a time) and report."""
    source = open_corpus(path, allow_outside=allow_outside)
    spec = CutSpec(capacity=capacity, window_documents=1 << 16, window_tokens=1 << 22)
    lengths: list[np.ndarray] = []
    spans: list[np.ndarray] = []
    reasons: Counter[str] = Counter()
    shown: list[dict[str, Any]] = []
    documents = supervised = ranges_unsupervised = 0
    for window in iter_windows(source, 0, spec):
        documents += window.documents
        lengths.append(np.diff(window.offsets))
        spans.append(window.stop - window.start)
        ranges_unsupervised += window.ranges_unsupervised
        if window.mask is not None:
            supervised += _supervised_targets(window)
        for q in window.quarantined:
            reasons[q["reason"]] += 1
            if len(shown) < examples:
                shown.append(q)
    all_lengths = np.concatenate(lengths) if lengths else np.zeros(0, np.int64)
    pairs = np.concatenate(spans) - 1 if spans else np.zeros(0, np.int64)
    rows = _next_fit_rows(pairs, capacity)
    names = ("min", "p50", "p90", "p99", "max")
    quantiles = (
        {
            n: int(v)
            for n, v in zip(names, np.quantile(all_lengths, QUANTILES, method="lower"), strict=True)
        }
        if len(all_lengths)
        else {n: 0 for n in names}
    )
    return CorpusReport(
        path=str(path),
        reader=type(source).__name__,
        random_access=bool(source.random_access),
        documents=documents,
        kept=len(all_lengths),
        tokens=int(all_lengths.sum()),
        length_quantiles=quantiles,
        capacity=capacity,
        rows=rows,
        fill=float(pairs.sum() / (rows * capacity)) if rows else 0.0,
        quarantined=dict(reasons),
        examples=shown,
        binding=dataclasses.asdict(source.binding),
        supervised=supervised if source.masked else None,
        ranges_unsupervised=ranges_unsupervised,
        targets=int(pairs.sum()),
    )


def _supervised_targets(window: Window) -> int:
    """Targets of the window's ranges that its mask marks: ``mask[start + 1:stop]``."""
    assert window.mask is not None
    running = np.concatenate([[0], np.cumsum(window.mask, dtype=np.int64)])
    first = window.offsets[:-1]
    return int((running[first + window.stop] - running[first + window.start + 1]).sum())
