"""The supervision mask through the service (rule C5, issue 20): the producer builds a
batch's mask from its own window, exactly as the in-process ``digest`` packs it; a
worker packs a window with its mask and refuses a malformed one; an unmasked corpus's
stream is byte-identical to what it was before masks existed."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time

import numpy as np
import pytest
import zmq
from _formats import documents, write_shards
from _formats import masks as prompt_response_masks
from _service import (
    FIXTURE,
    SMALL,
    Service,
    drain_ranks,
    expected,
    next_message,
    start,
    stream_digest,
)

from streampack import Examples, PackConfig, pack_examples, wire
from streampack.corpus import open_corpus
from streampack.service.plan_check import contract_plan
from streampack.service.planned import plan_batches
from streampack.windows import CutSpec, Window, iter_windows
from streampack.wire import window_examples

BINDING = wire.binding_from_wire(
    {"vocab_size": 512, "tokenizer": "t", "split_receipt": "r", "partition": "train"}
)


def masked_window(whole: bool, seed: int = 0) -> Window:
    """A window of 30 masked documents; ``whole=False`` selects an interior range of
    each, as a JSON Lines ``start``/``stop`` would (the producer then gathers)."""
    docs = documents(30, seed)
    masks = prompt_response_masks(docs, seed)
    examples = Examples.from_documents(docs, masks=masks)
    lengths = np.diff(examples.offsets)
    start = np.zeros(len(docs), np.int64) if whole else np.minimum(1, lengths - 2)
    return Window(
        epoch=0,
        index=0,
        documents=len(docs),
        tokens=examples.tokens.astype(np.uint16),
        offsets=examples.offsets,
        start=start,
        stop=lengths.copy(),
        source_id=np.arange(len(docs), dtype=np.int64),
        example_id=np.arange(len(docs), dtype=np.int64),
        quarantined=[],
        mask=examples.mask,
    )


@pytest.mark.parametrize("whole", [True, False], ids=["whole", "ranges"])
@pytest.mark.parametrize("policy", PackConfig.POLICIES)
def test_the_producers_batches_carry_the_windows_mask_as_digest_packs_it(whole, policy):
    window = masked_window(whole)
    config = PackConfig(
        capacity=64,
        max_rows_per_batch=2,
        policy=policy,
        open_rows=4 if policy == "best_fit" else None,
    )
    plan = contract_plan(window, config)
    planned = plan_batches(window, plan, BINDING, 64, 2, policy)
    compact = [p.compact() for p in planned]
    # The oracle: what ``streampack digest`` packs from the same window.
    want = pack_examples(window_examples(window.arrays()), BINDING, config).batches
    plain = pack_examples(
        window_examples(window.arrays() | {"mask": wire.NO_MASK}), BINDING, config
    ).batches
    assert len(compact) == len(want) == len(plain)
    for c, w, p in zip(compact, want, plain):
        assert c.mask is not None and c.mask.shape == c.tokens.shape
        batch = c.checked(max_cells=128).expand()
        assert batch.digest() == w.digest() != p.digest()
        assert c.supervised_targets == int(w.loss_mask.sum()) < int(w.target_valid.sum())
        each = [int(w.loss_mask[o["row"], o["start"] : o["stop"]].sum()) for o in w.occurrences]
        assert c.supervised_targets_by_occurrence().tolist() == each
    # What the producer counts and routes without gathering: the same as from the batch
    for p, c in zip(planned, compact):
        assert p.supervised_targets_by_occurrence().tolist() == (
            c.supervised_targets_by_occurrence().tolist()
        )
        assert p.supervised_targets == c.supervised_targets and p.nbytes == c.nbytes
        assert p.route_digest() == wire.frames_digest(wire.batch_arrays(c))


def test_an_unmasked_corpus_streams_exactly_as_before_masks_existed():
    """``streampack digest`` of the fixture corpus for rank 1 of 2, computed at commit
    69d2882 (before masks), and again when occurrence records came to name their
    source in place of the window-local ``doc`` (wire version 8; the stream digest
    hashes the records, and no longer a separate source array): the cells of every
    batch are those of then, and so are the other record fields."""
    pinned = {
        "next_fit": ("c87d2982a2e30321ec0e2b7e8d683e33f9191f2bbed9d714aa2f7e5c9aaa2edf", 25),
        "best_fit": ("ad62c896a13f96038b4ad224c154acdd05708deec9cd87d210bd86a3f5439867", 24),
    }
    for policy, (digest, batches) in pinned.items():
        got = expected(FIXTURE, 1, 2, policy=policy)
        assert (got["digest"], got["batches"]) == (digest, batches)


def _window_message(window: Window, **arrays: np.ndarray) -> list:
    fields = {
        "epoch": 0,
        "window": window.index,
        "binding": wire.binding_to_wire(BINDING),
        "config": {"capacity": 64, "max_rows_per_batch": 2},
        "with_tokens": True,
    }
    return wire.encode("window", fields, window.arrays() | arrays)


def test_a_worker_packs_a_masked_window_and_refuses_a_malformed_mask():
    """This test plays the producer to a real worker process (auditing every batch, so
    it asks for tokens and masks): a masked window is packed and audited; a window whose
    mask frame does not match its tokens, or whose piece starts or sources are not one
    per document, is answered with ``error``, and the worker goes on packing."""
    context = zmq.Context()
    router = context.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    worker = start(
        "worker",
        "--connect",
        f"tcp://127.0.0.1:{port}",
        "--audit-every",
        "1",
        stdout=subprocess.DEVNULL,
    )
    try:
        assert router.poll(120_000)
        identity, *frames = router.recv_multipart()
        assert wire.decode(frames).kind == "ready"

        window = masked_window(whole=True)
        router.send_multipart([identity, *_window_message(window, mask=window.mask[:-1])])
        refused = next_message(router, {"error", "packed", "failed"})
        assert refused.kind == "error" and "mask frame of shape" in refused.fields["message"]
        for name in ("piece_start", "source"):
            short = {name: window.arrays()[name][:-1]}
            router.send_multipart([identity, *_window_message(window, **short)])
            refused = next_message(router, {"error", "packed", "failed"})
            assert refused.kind == "error", refused.fields
            assert f"{name} frame of shape" in refused.fields["message"]
        router.send_multipart([identity, *_window_message(window)])
        packed = next_message(router, {"packed", "failed"})
        assert packed.kind == "packed", packed.fields
        config = PackConfig(capacity=64, max_rows_per_batch=2)
        plan = contract_plan(window, config)
        np.testing.assert_array_equal(packed.arrays["occurrences"], plan.occurrences)
        assert packed.fields["audited"] == len(plan.sizes) > 0
        assert packed.fields["audit_failures"] == 0, packed.fields["audit_error"]
        assert worker.poll() is None
    finally:
        worker.kill()
        worker.wait()
        router.close(linger=0)
        context.term()


@pytest.mark.slow
def test_a_masked_token_shard_corpus_arrives_exactly_once_with_its_masks(tmp_path):
    """Through real processes, 2 ranks, a worker killed mid-stream: each rank receives
    the stream the in-process ``digest`` computes, masks included."""
    docs = documents(1500, seed=3)
    corpus = write_shards(tmp_path, docs, supervision=prompt_response_masks(docs, seed=3))
    spec = CutSpec(
        capacity=SMALL["capacity"],
        window_documents=SMALL["window_documents"],
        window_tokens=SMALL["window_tokens"],
    )
    assert next(iter_windows(open_corpus(corpus), 0, spec)).mask is not None
    # A reorder budget of a few batches paces cutting by the ranks' fetches.
    settings = {"heartbeat_timeout": 2.0, "reorder_budget_bytes": 30_000}
    reference = {rank: expected(corpus, rank, 2, **settings) for rank in (0, 1)}
    (tmp_path / "plain").mkdir()
    plain = write_shards(tmp_path / "plain", docs, supervision=[[1] * len(d) for d in docs])
    assert reference[0]["digest"] != expected(plain, 0, 2, **settings)["digest"]  # masks matter
    with Service(corpus, **settings) as service:
        victim = service.add_worker()

        def kill_once_it_holds_windows():
            # Once the ranks are being served, freeze the only worker: the producer keeps
            # handing it windows, which it holds; then kill it and start a replacement.
            deadline = time.monotonic() + 120
            while service.stats()["batches_served"] < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(victim.pid, signal.SIGSTOP)
            while service.stats()["windows_in_flight"] == 0 and time.monotonic() < deadline:
                time.sleep(0.02)
            os.kill(victim.pid, signal.SIGKILL)  # whatever it held goes to the next worker
            victim.wait()
            service.add_worker()

        killer = threading.Thread(target=kill_once_it_holds_windows, daemon=True)
        killer.start()
        received = drain_ranks(service.consumer_endpoint, 2)
        killer.join(60)
        final = service.stats()
    # The victim's windows went elsewhere: reissued once it was found lost, or copied
    # as backups first (an overdue window is backed up before the heartbeat deadline).
    assert final["workers_lost"] + final["windows_backed_up"] >= 1
    served = sum(int(b.loss_mask.sum()) for items in received.values() for _, b in items)
    assert served <= final["supervised_targets_served"] < final["tokens_served"]  # replays count
    for rank in (0, 1):
        assert stream_digest(received[rank]) == (
            reference[rank]["digest"],
            reference[rank]["batches"],
        )
        supervised = sum(int(b.loss_mask.sum()) for _, b in received[rank])
        assert 0 < supervised < sum(int(b.target_valid.sum()) for _, b in received[rank])


def test_the_producer_counts_the_supervised_targets_it_serves():
    """Unmasked, every real target is supervised: the counter equals tokens_served and
    the stream's own count (masked corpora: the e2e test above)."""
    from _harness import Harness

    harness = Harness()
    harness.join(b"w1")
    harness.drain(b"c", 0, 1)
    counters = harness.counters
    want = sum(int(b.loss_mask.sum()) for _, _, b in _rank0_stream())
    assert counters["supervised_targets_served"] == counters["tokens_served"] == want > 0


def _rank0_stream():
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    return rank_stream(ProducerSettings(corpus=str(FIXTURE), **SMALL), 0, 1)
