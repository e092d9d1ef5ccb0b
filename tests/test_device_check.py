"""benchmarks/device_check.py, as a GPU host runs it, on the CPU with the tiny model: so that it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import REPO

pytestmark = pytest.mark.e2e


def test_device_check_runs_on_the_cpu_and_reports_its_figures(tmp_path):
    out = tmp_path / "device_check.json"
    result = subprocess.run([sys.executable, "benchmarks/device_check.py", "--device", "cpu", "--steps", "2",
                             "--no-real-size", "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["bf16_peak_tflops"] is None and len(record["load_average_before"]) == 3
    tiny = record["checks"]["tiny"]
    assert tiny["parameters"] == 3_217_152  # the tiny_arith preset (tied head counted once), on the meta device
    assert tiny["mfu"] is None and tiny["train_tflops_per_s"] > 0 and tiny["gen_tokens_per_s"] > 0
    # fp32, every parameter once plus the tied head's own copy (vLLM's CPU backend keeps one): 2% of this model
    assert tiny["parameters"] * 4 < tiny["sync_bytes"] < tiny["parameters"] * 4 * 1.05
    assert 0 < tiny["sync_gb_per_s"] and 0 < tiny["device_copy_gb_per_s"] and tiny["sync_vs_copy"] > 0
    assert tiny["logprob_diff"] < 1e-5
    assert "tiny:" in result.stdout and "generated tokens/s" in result.stdout
