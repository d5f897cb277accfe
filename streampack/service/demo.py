"""``streampack demo``: the whole service on the bundled corpus, verified.

Starts ``streampack serve`` with 2 pack workers (auditing every 8th batch) on free
local ports, drains two consumer ranks in this process with ``BatchStream``, prints a
progress line while they run, then a summary: documents, occurrences, targets, batches
per rank, fill ratio, tokens/s, the audit result and a check that every selected
(document, range) arrived exactly once across the ranks. Exits 0 when the check and
the audit pass.

The corpus is ``fixtures/corpus`` of the source checkout (found from the current
directory or from this package's location); an installed copy needs ``--corpus``.
"""

from __future__ import annotations

import argparse
import collections
import json
import logging
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any

import numpy as np

from ..client import BatchStream
from ..corpus import open_corpus
from ..errors import InvalidConfig, StreampackError
from ..progress import Progress
from ..settings import check_number
from ..windows import CutSpec, iter_windows
from .consume import occurrence_ids
from .health import check

logger = logging.getLogger(__name__)

DEMO_SETTINGS: dict[str, int | str] = {
    "capacity": 256,
    "max_rows_per_batch": 4,
    "window_documents": 64,
    "window_tokens": 8192,
    "epochs": 1,
    "tail": "fill",
}
RANKS = 2


def find_corpus(given: str | None) -> Path:
    if given:
        return Path(given)
    # This file is streampack/service/demo.py: the checkout is three folders up.
    for base in (Path.cwd(), Path(__file__).resolve().parents[2]):
        candidate = base / "fixtures" / "corpus" / "manifest.json"
        if candidate.is_file():
            return candidate.parent
    raise InvalidConfig(
        "the bundled corpus fixtures/corpus was not found (it ships with "
        "the source checkout, not with the installed package); pass --corpus PATH to a "
        "corpus manifest or directory"
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def expected_pairs(corpus: Path, spec: CutSpec) -> tuple[np.ndarray, int, dict[str, int]]:
    """The (source_id, range_start, range_stop, source) the service must deliver (as
    ``consume.occurrence_ids``), screened alike; ranges in document coordinates."""
    rows = []
    documents = 0
    reasons: dict[str, int] = collections.Counter()
    for window in iter_windows(open_corpus(corpus), 0, spec):
        documents += window.documents
        rows.append(
            np.stack(
                [
                    window.source_id,
                    window.piece_start + window.start,
                    window.piece_start + window.stop,
                    window.source_index,
                ],
                axis=1,
            )
        )
        for record in window.quarantined:
            reasons[record["reason"]] += 1
    return np.concatenate(rows), documents, dict(reasons)


class _Rank:
    def __init__(self, rank: int) -> None:
        self.rank = rank
        self.batches = 0
        self.fillers = 0
        self.targets = 0
        self.cells = 0
        self.valid = 0
        self.ids: list[np.ndarray] = []
        self.error: BaseException | None = None
        self.done = False

    def run(self, endpoint: str) -> None:
        try:
            with BatchStream(endpoint, rank=self.rank, world_size=RANKS, timeout=120) as stream:
                for batch in stream:
                    self.batches += 1
                    self.fillers += int(batch.filler)
                    if not batch.filler:
                        self.targets += int(np.count_nonzero(batch.loss_mask))
                        self.cells += batch.rows * batch.capacity
                        self.valid += int(np.asarray(batch.valid_lengths).sum())
                        self.ids.append(occurrence_ids(batch))
        except BaseException as exc:  # reported in the summary
            self.error = exc
        finally:
            self.done = True


def configure(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--corpus",
        help="corpus manifest or directory (default: fixtures/corpus of the source checkout)",
    )
    parser.add_argument("--workers", type=int, default=2, help="pack workers (default: 2)")
    parser.add_argument(
        "--quiet",
        action="store_true",
        help="no progress line (there is none unless stderr is a terminal)",
    )
    parser.add_argument(
        "--audit-every",
        type=int,
        default=8,
        help="audit every N-th batch per worker; 0 = no audit (default: 8)",
    )


def _serve_command(
    corpus: Path,
    args: argparse.Namespace,
    worker_endpoint: str,
    consumer_endpoint: str,
    quarantine: Path,
) -> list[str]:
    """``streampack serve`` on ``corpus`` with the demo's settings, as a command line."""
    command = [
        sys.executable,
        "-m",
        "streampack.cli",
        "serve",
        "--corpus",
        str(corpus),
        "--workers",
        str(args.workers),
        "--audit-every",
        str(args.audit_every),
        "--worker-endpoint",
        worker_endpoint,
        "--consumer-endpoint",
        consumer_endpoint,
        "--quarantine-path",
        str(quarantine),
    ]
    for key, value in DEMO_SETTINGS.items():
        command += ["--" + key.replace("_", "-"), str(value)]
    return command


def _wait_until_serving(serve: subprocess.Popen, log: IO[str], consumer_endpoint: str) -> None:
    """Return once the producer answers a health probe; raise, with serve's last line,
    when serve exits first or does not serve within 120 s."""
    deadline = time.monotonic() + 120
    while check(consumer_endpoint, 1.0) is None:
        if serve.poll() is not None or time.monotonic() > deadline:
            log.flush()
            # serve's last line says why (its one-line error when it refused to start).
            said = Path(log.name).read_text().strip().splitlines() or ["no output"]
            how = (
                f"exited with status {serve.returncode}"
                if serve.poll() is not None
                else "did not serve within 120 s"
            )
            raise StreampackError(f"serve {how}: {said[-1]}")


def _drain(ranks: list[_Rank], consumer_endpoint: str, quiet: bool) -> float:
    """Run every rank in its own thread until its stream ends, with a progress line;
    the seconds from the first batch received to the end."""
    progress = Progress("demo", unit="batches", enabled=not quiet)
    started = time.perf_counter()
    threads = [threading.Thread(target=r.run, args=(consumer_endpoint,)) for r in ranks]
    for thread in threads:
        thread.start()
    while not all(r.done for r in ranks):
        time.sleep(0.25)
        if not any(r.batches for r in ranks):
            started = time.perf_counter()  # rate from the first batch on
            progress.start()
            continue
        progress.update(
            sum(r.batches for r in ranks),
            sum(r.valid for r in ranks),
            note=f"per rank {[r.batches for r in ranks]}",
        )
    progress.close()
    seconds = time.perf_counter() - started
    for thread in threads:
        thread.join()
    return seconds


def _serve_and_drain(
    corpus: Path, args: argparse.Namespace
) -> tuple[list[_Rank], float, dict[str, Any]]:
    """Start serve on free local ports, drain every rank, stop serve: the ranks, the
    seconds they streamed, and the producer's counters at the end."""
    worker_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    consumer_endpoint = f"tcp://127.0.0.1:{_free_port()}"
    scratch = tempfile.TemporaryDirectory(prefix="streampack-demo-")
    quarantine = Path(scratch.name) / "quarantine.jsonl"
    command = _serve_command(corpus, args, worker_endpoint, consumer_endpoint, quarantine)
    logger.info("serving %s with %d workers to %d consumer ranks", corpus, args.workers, RANKS)
    log = open(quarantine.parent / "serve.log", "w")
    serve = subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=log, env={**os.environ, "PYTHONUNBUFFERED": "1"}
    )
    try:
        _wait_until_serving(serve, log, consumer_endpoint)
        ranks = [_Rank(r) for r in range(RANKS)]
        seconds = _drain(ranks, consumer_endpoint, args.quiet)
        status = check(consumer_endpoint, 10.0) or {"stats": {}}
    finally:
        serve.terminate()
        try:
            serve.wait(15)
        except subprocess.TimeoutExpired:
            serve.kill()
            serve.wait()
        log.close()
        scratch.cleanup()
    return ranks, seconds, status["stats"]


def _summary(
    corpus: Path, ranks: list[_Rank], seconds: float, stats: dict[str, Any], audit_every: int
) -> dict[str, Any]:
    """What the ranks received against what the corpus should give: the summary's
    figures and its three verdicts (exactly once, equal counts, audit passed)."""
    spec = CutSpec(
        capacity=int(DEMO_SETTINGS["capacity"]),
        window_documents=int(DEMO_SETTINGS["window_documents"]),
        window_tokens=int(DEMO_SETTINGS["window_tokens"]),
    )
    want, documents, reasons = expected_pairs(corpus, spec)
    got = (
        np.concatenate([i for r in ranks for i in r.ids])
        if any(r.ids for r in ranks)
        else np.zeros((0, 4), np.int64)
    )

    def in_order(a: np.ndarray) -> np.ndarray:
        return a[np.lexsort(a.T[::-1])]

    exactly_once = got.shape == want.shape and np.array_equal(in_order(got), in_order(want))
    equal_counts = len({r.batches for r in ranks}) == 1
    cells = sum(r.cells for r in ranks)
    valid = sum(r.valid for r in ranks)
    audited, failures = stats.get("audited", 0), stats.get("audit_failures", 0)
    audit_ok = failures == 0 and (audited > 0 or audit_every == 0)
    return {
        "documents": documents,
        "selected": int(want.shape[0]),
        "quarantined": dict(reasons),
        "occurrences": int(got.shape[0]),
        "targets": sum(r.targets for r in ranks),
        "batches_per_rank": [r.batches for r in ranks],
        "fillers_per_rank": [r.fillers for r in ranks],
        "fill_ratio": round(valid / cells, 4) if cells else 0.0,
        "tokens_per_second": round(valid / seconds, 1),
        "seconds": round(seconds, 3),
        "audit": {"batches": audited, "failures": failures, "passed": audit_ok},
        "exactly_once": bool(exactly_once),
        "equal_batches_per_rank": equal_counts,
    }


def _print_summary(
    summary: dict[str, Any], valid: int, seconds: float, stats: dict[str, Any], audit_every: int
) -> None:
    """The summary for a person (one figure a line), then as one JSON line."""
    documents, selected = summary["documents"], summary["selected"]
    audit = summary["audit"]
    exactly_once, equal_counts = summary["exactly_once"], summary["equal_batches_per_rank"]
    why = ", ".join(f"{reason}: {n}" for reason, n in sorted(summary["quarantined"].items()))
    print(
        f"documents     {documents} ({selected} selected, "
        f"{documents - selected} quarantined{f' - {why}' if why else ''})"
    )
    print(f"occurrences   {summary['occurrences']}   targets {summary['targets']}")
    print(f"batches/rank  {summary['batches_per_rank']} (fillers {summary['fillers_per_rank']})")
    print(
        f"fill ratio    {summary['fill_ratio']:.3f}   "
        f"throughput {valid / seconds / 1e6:.3f} M tokens/s over {seconds:.2f}s"
        f"{' (workers auditing)' if audit_every else ''}"
    )
    print(
        f"audit         {audit['batches']} batches audited, {audit['failures']} failed"
        f"{'' if audit['passed'] else '  <-- FAILED'}"
    )
    if audit["failures"]:
        print(f"              {stats.get('last_audit_error', '')[:300]}")
    print(
        f"exactly once  {'yes' if exactly_once else 'NO'}: every selected (document, range) "
        f"arrived {'exactly once' if exactly_once else 'NOT exactly once'} across "
        f"{RANKS} ranks; equal batches per rank: {'yes' if equal_counts else 'NO'}"
    )
    print(json.dumps(summary), flush=True)


def main(args: argparse.Namespace) -> int:
    check_number("--workers", args.workers, minimum=1, integer=True)
    check_number("--audit-every", args.audit_every, minimum=0, integer=True)
    corpus = find_corpus(args.corpus)
    ranks, seconds, stats = _serve_and_drain(corpus, args)
    for r in ranks:
        if r.error is not None:
            print(f"demo: rank {r.rank} failed: {r.error!r}", flush=True)
            return 1
    summary = _summary(corpus, ranks, seconds, stats, args.audit_every)
    _print_summary(summary, sum(r.valid for r in ranks), seconds, stats, args.audit_every)
    passed = summary["exactly_once"] and summary["equal_batches_per_rank"]
    return 0 if passed and summary["audit"]["passed"] else 1
