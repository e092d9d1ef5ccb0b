"""`rl-tpu doctor +recipe=grpo_math`, through the `rl-tpu` command's own dispatch (`python -m rl_tpu.main doctor`),
on the real run machinery: the shipped warm-started tiny model, vLLM, Ray, the FSDP2 trainer, the arithmetic reward.
It passes with exit status 0, prints one line per check and writes them to doctor.json. The causes each check names
are injected in tests/unit/test_doctor.py."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

CHECKS = (
    "chat template",
    "EOS reachable",
    "reward variance",
    "gradient",
    "canary",
    "tool calls",
    "logprob gap",
    "reward plugin",
)


def test_the_doctor_passes_the_default_recipe_and_prints_every_check(tmp_path):
    out = tmp_path / "doctor"
    command = [sys.executable, "-m", "rl_tpu.main", "doctor", "+recipe=grpo_math", f"hydra.run.dir={out}"]
    result = subprocess.run(
        [*command, f"cache_dir={tmp_path / 'cache'}"], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    record = json.loads((out / "doctor.json").read_text())
    assert record["passed"] and record["error"] is None and record["steps"] == 2
    status = {c["name"]: c["status"] for c in record["checks"]}
    assert tuple(status) == CHECKS
    for check in record["checks"]:
        assert f"{check['name']:<17} {check['status']}: {check['detail']}" in result.stdout
    assert "doctor: passed (2 steps" in result.stdout
    # the recipe's model has no chat template nor tools
    assert status.pop("tool calls") == "not available"
    assert set(status.values()) == {"passed"}
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [0, 1, 2]  # the step-0 evaluation (one held-out prompt), then the two short steps
