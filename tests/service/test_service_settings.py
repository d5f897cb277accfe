"""Service settings (TOML + flags) and the small commands: digest, health, demo's corpus."""

from __future__ import annotations

import argparse
import json
import subprocess

import pytest
from _service import FIXTURE, ROOT, command, env, expected, flags, free_port

from streampack import InvalidConfig
from streampack.settings import (
    ConsumerSettings,
    ProducerSettings,
    WorkerSettings,
    add_flags,
    build,
    from_args,
    load_toml,
)


def test_defaults_are_valid_and_bind_loopback():
    settings = ProducerSettings()
    assert settings.worker_endpoint.startswith("tcp://127.0.0.1:")
    assert settings.consumer_endpoint.startswith("tcp://127.0.0.1:")
    WorkerSettings()
    ConsumerSettings()


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("worker_endpoint", "127.0.0.1:5555", "is not a ZeroMQ endpoint"),
        ("tail", "pad", "tail = 'pad'; expected one of"),
        ("capacity", 0, "capacity = 0 must be an integer >= 1"),
        ("window_tokens", 100, "window_tokens = 100 must be an integer >= 2049"),
        ("max_cells", 10, "max_cells = 10 must be an integer >= 2048"),
        ("heartbeat_timeout", 0, "heartbeat_timeout = 0 must be a number > 0"),
        ("shuffle", "yes", "shuffle = 'yes' must be true or false"),
        ("epochs", -1, "epochs = -1"),
        ("policy", "first_fit", "policy = 'first_fit'; expected one of next_fit, best_fit$"),
        ("open_rows", 0, "open_rows = 0 must be an integer >= 1"),
        ("open_rows", 8, "open_rows=8 with policy='next_fit'"),
    ],
)
def test_bad_values_name_the_field_and_what_is_accepted(field, value, match):
    with pytest.raises(InvalidConfig, match=match):
        ProducerSettings(**{field: value})


def test_policy_flags_reach_the_pack_config():
    parser = argparse.ArgumentParser()
    add_flags(parser, ProducerSettings)
    args = parser.parse_args(["--policy", "best_fit", "--open-rows", "16"])
    config = from_args(ProducerSettings, args).pack_config()
    assert (config.policy, config.open_rows) == ("best_fit", 16)
    default = ProducerSettings(policy="best_fit").pack_config()
    assert (default.policy, default.open_rows) == ("best_fit", 16)
    assert ProducerSettings().pack_config().policy == "next_fit"


def test_toml_tables_and_flags_layer(tmp_path):
    path = tmp_path / "service.toml"
    path.write_text("[producer]\ncapacity = 512\nepochs = 3\n\n[worker]\naudit_every = 4\n")
    parser = argparse.ArgumentParser()
    parser.add_argument("--config")
    add_flags(parser, ProducerSettings)
    args = parser.parse_args(["--config", str(path), "--epochs", "5", "--shuffle"])
    settings = from_args(ProducerSettings, args)
    assert (settings.capacity, settings.epochs, settings.shuffle) == (512, 5, True)
    assert build(WorkerSettings, load_toml(path)).audit_every == 4
    assert build(ConsumerSettings, load_toml(path)).prefetch == 4


@pytest.mark.parametrize(
    ("text", "match"),
    [
        (
            "[producer]\ncapacty = 3\n",
            "unknown \\[producer\\] setting\\(s\\) capacty; accepted: accumulation, .*capacity, ",
        ),
        ("[trainer]\nx = 1\n", "unknown settings table"),
        ("[producer\n", "is not valid TOML"),
        ("producer = 3\n", "must be a table"),
    ],
)
def test_bad_settings_files_are_refused(tmp_path, text, match):
    path = tmp_path / "bad.toml"
    path.write_text(text)
    with pytest.raises(InvalidConfig, match=match):
        build(ProducerSettings, load_toml(path))


def run(*args, cwd=ROOT, timeout=120):
    return subprocess.run(
        command(*args), cwd=cwd, env=env(), capture_output=True, text=True, timeout=timeout
    )


def test_digest_command_prints_the_in_process_stream(tmp_path):
    config = tmp_path / "service.toml"
    config.write_text(
        f'[producer]\ncorpus = "{FIXTURE}"\ncapacity = 256\n'
        "max_rows_per_batch = 4\nshuffle = true\nseed = 4\n"
    )
    out = run(
        "digest",
        "--config",
        str(config),
        "--window-documents",
        "40",
        "--window-tokens",
        "3000",
        "--rank",
        "1",
        "--world-size",
        "2",
    )
    assert out.returncode == 0, out.stderr
    line = json.loads(out.stdout.strip().splitlines()[-1])
    want = expected(FIXTURE, 1, 2, shuffle=True, seed=4)
    assert line["digest"] == want["digest"]
    assert (line["batches"], line["fillers"], line["tokens"]) == (
        want["batches"],
        want["fillers"],
        want["tokens"],
    )
    assert line["state"] == {"epoch": 1, "index": 1, "base": 0, "rank": 1, "world_size": 2}


def test_health_exits_1_when_no_producer_answers():
    out = run("health", "--connect", f"tcp://127.0.0.1:{free_port()}", "--timeout", "0.3")
    assert out.returncode == 1
    assert json.loads(out.stdout)["serving"] is False


def test_produce_without_a_corpus_says_how_to_give_one():
    out = run("produce", *flags({"worker_endpoint": f"tcp://127.0.0.1:{free_port()}"}))
    assert out.returncode != 0
    assert "pass --corpus PATH" in out.stderr


def test_demo_outside_a_checkout_asks_for_corpus(tmp_path, monkeypatch):
    from streampack.service import demo

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(demo, "__file__", str(tmp_path / "site" / "workers" / "demo.py"))
    with pytest.raises(InvalidConfig, match="pass --corpus PATH"):
        demo.find_corpus(None)
    assert demo.find_corpus(str(FIXTURE)) == FIXTURE


def test_demo_finds_the_checkouts_corpus_from_any_directory(tmp_path, monkeypatch):
    from streampack.service import demo

    monkeypatch.chdir(tmp_path)
    assert demo.find_corpus(None) == FIXTURE
