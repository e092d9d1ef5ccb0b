"""benchmarks/device_check.py, as a GPU host runs it, on the CPU with the tiny model: so that it cannot rot."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from conftest import REPO


def test_device_check_runs_on_the_cpu_and_reports_its_figures(tmp_path):
    out = tmp_path / "device_check.json"
    result = subprocess.run(
        [
            sys.executable,
            "benchmarks/device_check.py",
            "--device",
            "cpu",
            "--steps",
            "2",
            "--checks",
            "tiny",
            "trainer",
            "--trainer-shape",
            "tiny",
            "--prompts",
            "4",
            "--n",
            "4",
            "--prompt-len",
            "16",
            "--completion-len",
            "24",
            "--micro-batch-size",
            "8",
            "--profile",
            "--set",
            "trainer.logprob_chunk_size=16",
            "--out",
            str(out),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-4000:]
    record = json.loads(out.read_text())
    assert record["device"] == "cpu" and record["bf16_peak_tflops"] is None and len(record["load_average_before"]) == 3
    tiny = record["checks"]["tiny"]
    assert tiny["parameters"] == 3_217_152  # the tiny_arith preset (tied head counted once), on the meta device
    assert tiny["mfu"] is None and tiny["train_tflops_per_s"] > 0 and tiny["gen_tokens_per_s"] > 0
    assert tiny["sync_bytes"] == tiny["parameters"] * 4  # fp32, every parameter once: the tied head as the embedding
    assert 0 < tiny["sync_gb_per_s"] and 0 < tiny["device_copy_gb_per_s"] and tiny["sync_vs_copy"] > 0
    assert tiny["logprob_diff"] < 1e-5
    assert "tiny:" in result.stdout and "generated tokens/s" in result.stdout

    trainer = record["checks"]["trainer"]  # the trainer alone (no vLLM; Ray for the object store), fp32, tiny model
    assert trainer["parameters"] == 3_217_152 and trainer["steps_measured"] == 1
    assert trainer["workload"].startswith("tiny shape, float32,")
    assert "trainer.logprob_chunk_size=16" in trainer["workload"]  # a --set setting, applied to the run's config:
    settings = trainer["trainer_settings"]
    assert settings["logprob_chunk_size"] == 16 and settings["micro_batch_size"] == 8
    assert trainer["logprob_diff_first_step"] < 1e-5  # against a plain fp32 Hugging Face forward
    # 16 sequences of 16 prompt and 1-24 completion tokens, each group's prompt once per micro-batch
    assert 16 + 16 < trainer["train_positions"] < 16 * (16 + 24)
    assert trainer["grad_norm"][0] > 0 and trainer["grad_norm"][0] != trainer["grad_norm"][1]  # the weights moved
    # every published tensor came back with its checksum verified and equals the trainer's
    assert list(trainer["publish"]) == ["shm_file", "object_store"]
    for transport in trainer["publish"].values():
        assert transport["tensors"] == 46 and transport["mismatched"] == []  # the tied head once
        assert transport["bytes"] == trainer["parameters"] * 4
        assert 0 < transport["publish_s"] and 0 < transport["fetch_verify_s"]
    assert trainer["sync_gb_per_s"] == trainer["publish"]["shm_file"]["gb_per_s"] and trainer["gather_to_host_s"] > 0
    profile = trainer["profile"]
    assert 0 < profile["busy_s"] and any(op["op"] == "aten::mm" for op in profile["top_ops"])
    assert "trainer:" in result.stdout


NO_RAY_NO_VLLM = """
import runpy, sys
sys.modules["ray"] = sys.modules["vllm"] = None  # as on the lent GPU machines: importing either fails
sys.path.insert(0, "benchmarks")
sys.argv = ["benchmarks/device_check.py", *sys.argv[1:]]
runpy.run_path("benchmarks/device_check.py", run_name="__main__")
"""


def test_the_ipc_check_needs_neither_ray_nor_vllm_and_hands_every_bucket_over_verified(tmp_path):
    """On the CPU the handles are torch's shared memory instead of CUDA IPC: the same transport code, checksums and
    receiving process (a smoke test; the figures that count come from a GPU). The consistency certificate, which
    needs both, says it was skipped."""
    out = tmp_path / "ipc.json"
    args = ["--device", "cpu", "--checks", "ipc", "consistency", "--trainer-shape", "tiny", "--bucket-mb", "3"]
    args += ["--out", str(out)]
    result = subprocess.run(
        [sys.executable, "-c", NO_RAY_NO_VLLM, *args], cwd=REPO, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    ipc = json.loads(out.read_text())["checks"]["ipc"]
    assert ipc["bytes"] == 8 * 2**20 and ipc["buckets_verified"] == 3  # 3 + 3 + 2 MiB
    assert ipc["handoff_s"] == pytest.approx(ipc["put_s"] + ipc["open_verify_copy_s"])
    assert 0 < ipc["handoff_gb_per_s"] and 0 < ipc["device_copy_gb_per_s"]
    assert list(ipc["sender_memory_gib"]) == ["start", "buckets_gathered", "handed_over", "released"]
    assert "ipc: 0.01 GB handed over" in result.stdout
    skipped = json.loads(out.read_text())["checks"]["consistency"]["skipped"]
    assert "needs vLLM and Ray" in skipped and f"consistency: {skipped}" in result.stdout
