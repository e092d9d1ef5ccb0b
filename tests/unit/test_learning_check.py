"""The learning regression check's verdict (benchmarks/learning_curves.py): a curve that leaves the recorded band
is named with how far and where it moved, and the check exits 1. The real curves run in tests/e2e/test_learning.py;
a run that learns nothing is a flat curve at the untrained reward, given here directly (a 12-step run with a
learning rate of 0 was the suite's slowest way to draw a flat line)."""

from __future__ import annotations

import importlib.util
import json
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def learning_curves():
    sys.path.insert(0, str(REPO / "benchmarks"))  # the script imports `record` from beside itself
    try:
        spec = importlib.util.spec_from_file_location("learning_curves", REPO / "benchmarks" / "learning_curves.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.fixture(scope="module")
def reference(learning_curves) -> dict:
    return json.loads(learning_curves.REFERENCE.read_text())


def untrained(reference: dict) -> list[float]:
    """What a run that learns nothing draws: every step at the recorded curve's first reward."""
    steps = len(reference["cases"]["vanilla"]["seeds"][0])
    return [reference["cases"]["vanilla"]["mean"][0]] * steps


def test_each_recorded_seed_stays_in_its_own_band(learning_curves, reference):
    for case in learning_curves.CASES:
        for curve in reference["cases"][case]["seeds"]:
            assert learning_curves.compare(case, curve, case, reference)["ok"]


def test_a_run_that_learns_nothing_leaves_the_band_and_says_how_far_its_curve_moved(learning_curves, reference):
    result = learning_curves.compare("lr_zero", untrained(reference), "vanilla", reference)
    assert not result["ok"]
    assert result["message"].startswith(
        "lr_zero: the reward curve left the band around vanilla's recorded curve: it moved -"
    )
    assert "at steps 10-12" in result["message"]  # the last block, where the recorded curve has risen most


def test_the_check_exits_1_and_prints_the_verdict_when_a_curve_leaves_its_band(
    learning_curves, reference, monkeypatch, tmp_path, capsys
):
    curves = {"vanilla": reference["cases"]["vanilla"]["seeds"][0], "lr_zero": untrained(reference)}
    monkeypatch.setattr(learning_curves, "run_sweep", lambda work, cases, seed: {c: curves[c] for c in cases})
    out = tmp_path / "check.json"
    argv = ["learning_curves.py", "check", "--cases", "vanilla,lr_zero:vanilla", "--out", str(out)]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as stopped:
        learning_curves.main()
    assert stopped.value.code == 1
    printed = capsys.readouterr().out
    results = {r["case"]: r for r in json.loads(out.read_text())}
    assert results["vanilla"]["ok"] and not results["lr_zero"]["ok"]
    assert results["lr_zero"]["message"] in printed
