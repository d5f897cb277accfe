"""transformers' Trainer and TRL's SFTTrainer on the stream, in real processes
(torchrun, gloo, DDP) against a real ``streampack serve``: every rank trains exactly its
``digest`` stream, the loss and the parameters equal the hand loop's (README, "Exact
loss over an optimizer step"), a run killed after a checkpoint resumes from it on 2
processes and on 1 with every batch trained exactly once and no prefix served again."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch", reason="the hf extra is not installed")
pytest.importorskip("transformers", reason="the hf extra is not installed")
pytest.importorskip("accelerate", reason="the hf extra is not installed")

from _service import ROOT, env, free_port  # noqa: E402
from _trainers import fingerprint, tiny_llama  # noqa: E402
from test_readme_trainers import readme_block, run_block  # noqa: E402

from streampack.client import resume_cursor  # noqa: E402
from streampack.integrations.hf import STATE_FILE, load_stream_state  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2
ACCUMULATION = 2
PREFETCH = 2  # a small look-ahead, so that a replayed prefix shows in batches_served
LEARNING_RATE = 0.5  # as tests/_trainers.py


def oracle(settings: dict, rank: int, world_size: int, start=None, count=None) -> list:
    """The batches ``rank`` of ``world_size`` receives, as the in-process digest computes."""
    from streampack.service.digest import rank_stream
    from streampack.settings import ProducerSettings

    batches = []
    for _, _, batch in rank_stream(ProducerSettings(**settings), rank, world_size, start):
        if count is not None and len(batches) == count:
            break
        batches.append(batch)
    return batches


def global_batches(settings: dict, count: int) -> list:
    """Global batches ``0 .. count - 1`` at ``WORLD`` ranks (each with its step's targets)."""
    per_rank = [oracle(settings, r, WORLD, count=count // WORLD) for r in range(WORLD)]
    return [per_rank[g % WORLD][g // WORLD] for g in range(count)]


def hand_loop(steps: list[list]) -> tuple[list[float], dict]:
    """The README's exact step in one process: each step's loss is the sum over its
    batches of ``model(**to_hf(num_items_in_batch=True)).loss`` (NLL sum / step_targets;
    under DDP each rank's share times W, averaged by DDP: the same sum), then SGD."""
    model = tiny_llama(vocab=steps[0][0].binding.vocab_size).train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LEARNING_RATE)
    losses = []
    for batches in steps:
        loss = sum(model(**b.to_hf(pad_id=0, num_items_in_batch=True)).loss for b in batches)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses, {n: p.detach() for n, p in model.named_parameters()}


def assert_parameters_equal(got: dict, want: dict, tolerance: float) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        gap = (got[name] - value).abs().max().item()
        assert gap <= tolerance * (1 + value.abs().max().item()), (name, gap)


def torchrun(config: dict, processes: int, folder: Path) -> subprocess.CompletedProcess:
    folder.mkdir(parents=True, exist_ok=True)
    config = {"out": str(folder), "accumulation": ACCUMULATION, "prefetch": PREFETCH, **config}
    path = folder / "config.json"
    path.write_text(json.dumps(config))
    environment = env() | {"OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={processes}",
            "--master-addr=127.0.0.1",
            f"--master-port={free_port()}",
            str(ROOT / "tests" / "_trainers.py"),
            str(path),
        ],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )


def records(folder: Path, rank: int) -> list[dict]:
    path = folder / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def assert_trained(trained: list[dict], batches: list) -> None:
    """The forwards a rank ran are exactly ``batches``, whole, each with its step's count."""
    assert [r["fingerprint"] for r in trained] == [fingerprint(b.to_hf(pad_id=0)) for b in batches]
    assert [r["num_items_in_batch"] for r in trained] == [max(b.step_targets, 1) for b in batches]


@pytest.fixture(scope="module")
def killed(service, tmp_path_factory):
    """A 2-rank run of 4 steps, checkpointing every 2, whose rank 1 is killed (SIGKILL)
    at the end of step 3: checkpoint-2 holds steps 1-2."""
    folder = tmp_path_factory.mktemp("killed")
    base = {"endpoint": service.consumer_endpoint, "vocab": 512, "max_steps": 4}
    run = {**base, "save_steps": 2, "output_dir": str(folder / "run"), "kill_at": 3}
    done = torchrun(run, WORLD, folder / "first")
    assert done.returncode != 0, "rank 1 was to be killed"
    assert (folder / "run" / "checkpoint-2" / "trainer_state.json").is_file(), done.stderr[-3000:]
    return folder, base


def test_trainer_on_2_ranks_killed_and_resumed_trains_the_stream_exactly_once(service, killed):
    folder, base = killed
    before = service.stats()["batches_served"]
    resumed = {**base, "save_steps": 2, "output_dir": str(folder / "run"), "resume": True}
    done = torchrun(resumed, WORLD, folder / "resumed")
    assert done.returncode == 0, done.stderr[-3000:]
    served = service.stats()["batches_served"] - before

    steps, per_step = 4, WORLD * ACCUMULATION
    batches = global_batches(service.settings, steps * per_step)
    for rank in range(WORLD):
        first = [r for r in records(folder / "first", rank) if r["step"] < 2]
        trained = first + records(folder / "resumed", rank)
        assert_trained(trained, batches[rank::WORLD])
    # The resumed run was served its own 8 batches and its look-ahead, not the prefix too.
    assert 2 * per_step <= served <= 2 * per_step + WORLD * PREFETCH

    final = torch.load(folder / "resumed" / "final.pt")
    losses, parameters = hand_loop(
        [batches[s * per_step : (s + 1) * per_step] for s in range(steps)]
    )
    # Trainer sums its logged loss in float32.
    assert final["losses"] == pytest.approx(losses, rel=1e-6)
    assert_parameters_equal(final["parameters"], parameters, 1e-10)


def test_a_2_rank_checkpoint_resumes_on_1_process_with_the_batches_no_rank_trained(service, killed):
    folder, base = killed
    checkpoint = folder / "run" / "checkpoint-2"
    before = service.stats()["batches_served"]
    elastic = {**base, "output_dir": str(folder / "elastic-run"), "resume": str(checkpoint)}
    done = torchrun(elastic, 1, folder / "elastic")
    assert done.returncode == 0, done.stderr[-3000:]
    served = service.stats()["batches_served"] - before

    start = resume_cursor(load_stream_state(str(checkpoint)), 0, 1)
    assert start == (0, 8, 8)  # 2 steps x 2 ranks x 2 micro-batches consumed
    later = oracle(service.settings, 0, 1, start=start, count=4)
    assert_trained(records(folder / "elastic", 0), later)
    assert 4 <= served <= 4 + PREFETCH

    earlier = global_batches(service.settings, 8)
    losses, parameters = hand_loop([earlier[:4], earlier[4:], later[:2], later[2:]])
    final = torch.load(folder / "elastic" / "final.pt")
    assert final["losses"] == pytest.approx(losses, rel=1e-6)
    assert_parameters_equal(final["parameters"], parameters, 1e-10)
    assert json.loads((checkpoint / STATE_FILE).read_text())["ranks"] == [
        {"epoch": 0, "index": 8 + r, "base": 0, "rank": r, "world_size": WORLD}
        for r in range(WORLD)
    ]


def test_sft_trainer_on_a_masked_chat_corpus_trains_only_the_responses_as_the_hand_loop(
    tmp_path, monkeypatch
):
    """Also runs the README's SFTTrainer block on one rank, against the same service."""
    pytest.importorskip("trl", reason="the sft extra is not installed")
    from _chat import CONVERSATIONS, make_tokenizer_dir
    from _service import Service, command

    tokenizer = make_tokenizer_dir(tmp_path / "my-tokenizer")
    (tmp_path / "chat.jsonl").write_text(
        "".join(json.dumps({"messages": m}) + "\n" for m in CONVERSATIONS * 40)
    )
    build = [
        *("corpus", "build", "--from", str(tmp_path / "chat.jsonl"), "--format", "messages"),
        *("--tokenizer", str(tokenizer), "--out", str(tmp_path / "corpus")),
    ]
    done = subprocess.run(command(*build), cwd=ROOT, env=env(), capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    manifest = json.loads((tmp_path / "corpus" / "manifest.json").read_text())
    steps = 2
    shapes = {"capacity": 128, "max_rows_per_batch": 2, "epochs": 1}
    with Service(
        tmp_path / "corpus", serve_workers=1, accumulation=ACCUMULATION, **shapes
    ) as service:
        config = {
            "kind": "sft",
            "endpoint": service.consumer_endpoint,
            "vocab": manifest["binding"]["vocab_size"],
            "tokenizer": str(tokenizer),
            "max_steps": steps,
            "output_dir": str(tmp_path / "run"),
        }
        done = torchrun(config, WORLD, tmp_path / "sft")
        assert done.returncode == 0, done.stderr[-3000:]
        batches = global_batches(service.settings, steps * WORLD * ACCUMULATION)
        monkeypatch.chdir(tmp_path)
        readme = run_block(readme_block("sft", service.consumer_endpoint), "sft")
        assert readme["trainer"].state.global_step == steps
    for rank in range(WORLD):
        assert_trained(records(tmp_path / "sft", rank), batches[rank::WORLD])
    # Only the assistant's tokens are trained: the prompts are context (labels -100).
    for batch in batches:
        assert 0 < int(batch.loss_mask.sum()) < int(batch.target_valid.sum())
    per_step = WORLD * ACCUMULATION
    losses, parameters = hand_loop(
        [batches[s * per_step : (s + 1) * per_step] for s in range(steps)]
    )
    final = torch.load(tmp_path / "sft" / "final.pt")
    assert final["losses"] == pytest.approx(losses, rel=1e-6)
    # TRL's fused LM head scores the tokens in float32 (the model is float64).
    assert_parameters_equal(final["parameters"], parameters, 1e-6)
