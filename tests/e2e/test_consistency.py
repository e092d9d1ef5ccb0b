"""`python -m rl_tpu.consistency` on the tiny model on CPU, fp32 and bf16: a vLLM engine and a trainer rank agree on
every next-token distribution within the dtype's bounds, and both certificates land in one record."""

from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO


def test_the_certificate_holds_for_the_tiny_model_in_fp32_and_bf16(tiny_model_dir, tmp_path):
    for dtype in ("float32", "bfloat16"):
        result = subprocess.run(
            [
                sys.executable,
                "-m",
                "rl_tpu.consistency",
                f"model.path={tiny_model_dir}",
                f"model.dtype={dtype}",
                "--sequences",
                "2",
                "--length",
                "12",
                "--out",
                str(tmp_path),
                "--name",
                "tiny",
            ],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-4000:]
    certificates = json.loads((tmp_path / "tiny.json").read_text())["certificates"]
    fp32, bf16 = certificates.values()
    assert fp32["dtype"] == "float32" and bf16["dtype"] == "bfloat16" and bf16["fp32_residual"]
    for certificate in (fp32, bf16):
        figures = certificate["figures"]
        assert certificate["exceeded"] == [] and figures["positions"] == 2 * 11
        assert certificate["inputs"].endswith("22 positions x 268 tokens")  # the whole vocabulary, each position
        assert 0 <= figures["kl_engine_trainer"] and 0 <= figures["kl_trainer_engine"]
    # fp32 agrees to rounding; bf16 differs, by far more, and still within its bounds
    assert fp32["figures"]["max_abs_logprob_diff"] < 1e-4 < bf16["figures"]["max_abs_logprob_diff"]
    assert (tmp_path / "tiny.md").read_text().count("| yes |") == 2
