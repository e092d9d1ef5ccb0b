"""The learning regression test: GRPO's reward curve, for three loss modes, stays in a band around the one
recorded in tests/fixtures/learning_curves.json (that a curve leaving the band fails the check:
tests/unit/test_learning_check.py).

One sweep of real runs (vLLM engine, FSDP2 trainer, Ray launcher), 12 steps each, from random weights on a
reward they can learn in seconds (tests/fixtures/rewards/digits.py); benchmarks/learning_curves.py runs it
and re-records the curves.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


@pytest.fixture(scope="module")
def learning_check(tmp_path_factory, ray_cluster) -> tuple[subprocess.CompletedProcess, dict[str, dict]]:
    """`ray_cluster`: another Ray cluster runs on this host meanwhile; the sweep must start one of its own
    (`ray.init(address="local")`), since joining that one fails on the CPU count it asks for."""
    work = tmp_path_factory.mktemp("learning")
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/learning_curves.py",
            "check",
            "--work",
            str(work / "sweep"),
            "--cases",
            "vanilla,gspo,cispo",
            "--out",
            str(work / "check.json"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert (work / "check.json").is_file(), result.stderr[-4000:]
    return result, {r["case"]: r for r in json.loads((work / "check.json").read_text())}


@pytest.mark.parametrize("case", ["vanilla", "gspo", "cispo"])
def test_the_reward_curve_stays_in_its_recorded_band(learning_check, case):
    _, results = learning_check
    assert results[case]["ok"], results[case]["message"]
    assert results[case]["blocks"][-1] > results[case]["blocks"][0] + 0.15  # it learned: the reward rose
