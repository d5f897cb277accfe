"""`streampack trace` reproduces the worked example of DESIGN section 1, value for value."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from streampack.trace import find_fixture, trace

SEED = Path(__file__).resolve().parents[2] / "fixtures" / "seed"


@pytest.fixture(scope="module")
def result() -> dict:
    return trace(find_fixture(None))


def test_trace_equals_the_golden_file(result):
    assert result == json.loads((SEED / "expected.json").read_text())


def test_trace_pins_the_design_values(result):
    rows = result["rows"]
    assert [r["inputs"] for r in rows] == [[0, 99, 100, 0, 101, -1], [0, 102, 103, 104, -1, -1]]
    assert [r["targets"] for r in rows] == [[99, 100, 1, 101, 1, -1], [102, 103, 104, 1, -1, -1]]
    assert [r["segments"] for r in rows] == [[0, 0, 0, 1, 1, -1], [2, 2, 2, 2, -1, -1]]
    assert [r["positions"] for r in rows] == [[0, 1, 2, 0, 1, 0], [0, 1, 2, 3, 0, 0]]
    assert result["allowed_keys"][0]["3"] == [3] and result["allowed_keys"][0]["4"] == [3, 4]
    assert "5" not in result["allowed_keys"][0]
    assert result["valid_targets"] == 9
    assert result["stats"]["cells"] == 12
    loss, tol = result["loss"], result["loss"]["tolerance"]
    ln2 = math.log(2)
    assert abs(loss["sum"] - 11 * ln2) <= tol and loss["sum"] == 7.624619
    assert abs(loss["mean"] - 11 / 9 * ln2) <= tol and loss["mean"] == 0.847180
    assert abs(loss["row_mean"] - 6 / 5 * ln2) <= tol and loss["row_mean"] == 0.831777
    assert abs(loss["document_mean"] - 4 / 3 * ln2) <= tol and loss["document_mean"] == 0.924196
    assert [o["document"] for o in result["occurrences"]] == ["A", "B", "C"]


def test_trace_command_prints_the_same_json(result):
    out = subprocess.run(
        [sys.executable, "-m", "streampack.cli", "trace", "--fixture", str(SEED)],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    assert json.loads(out) == result


def test_missing_fixture_is_a_clear_error(tmp_path):
    from streampack import InvalidConfig

    with pytest.raises(InvalidConfig, match="pass --fixture PATH"):
        find_fixture(str(tmp_path / "nowhere.json"))


def test_a_user_error_is_one_line_and_exit_code_2(tmp_path):
    run = subprocess.run(
        [sys.executable, "-m", "streampack.cli", "trace", "--fixture", str(tmp_path / "x.json")],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 2
    assert run.stderr.startswith("streampack trace: error: worked-example fixture not found")
    assert "Traceback" not in run.stderr
