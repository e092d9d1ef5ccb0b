"""The consistency certificate's measures (rl_tpu/models/agreement.py) against hand computations, and its command's
refusals, records and exit status (rl_tpu/consistency.py) without an engine."""

from __future__ import annotations

import json
import math

import pytest
import torch

from rl_tpu import consistency
from rl_tpu.models.agreement import BOUNDS, agreement, exceeded


def table(*rows: list[float]) -> torch.Tensor:
    return torch.tensor(rows, dtype=torch.float64).log()


def test_each_measure_matches_the_hand_computation():
    # position 0: p = (0.6, 0.4) against q = (0.3, 0.7); position 1: the same distribution on both sides
    engine, trainer = table([0.6, 0.4], [0.5, 0.5]), table([0.3, 0.7], [0.5, 0.5])
    kl_pq = 0.6 * math.log(0.6 / 0.3) + 0.4 * math.log(0.4 / 0.7)
    kl_qp = 0.3 * math.log(0.3 / 0.6) + 0.7 * math.log(0.7 / 0.4)
    figures = agreement(engine, trainer)
    assert figures["positions"] == 2
    assert figures["kl_engine_trainer"] == pytest.approx(kl_pq / 2, rel=1e-12)
    assert figures["kl_trainer_engine"] == pytest.approx(kl_qp / 2, rel=1e-12)
    assert figures["kl_engine_trainer_max"] == pytest.approx(kl_pq, rel=1e-12)
    assert figures["tv_max"] == pytest.approx(0.3, rel=1e-12) and figures["tv_mean"] == pytest.approx(0.15, rel=1e-12)
    assert figures["max_abs_logprob_diff"] == pytest.approx(
        math.log(0.6 / 0.3), rel=1e-12
    )  # the larger of ln 2 and ln 7/4
    assert figures["argmax_differs"] == 0.5  # position 0 flips; position 1 ties alike on both sides


def test_identical_tables_agree_exactly_and_rounding_never_makes_a_kl_negative():
    rows = torch.randn(5, 64, generator=torch.Generator().manual_seed(0)).log_softmax(-1).float()
    same = agreement(rows, rows)
    assert all(same[m] == 0 for m in ("kl_engine_trainer", "kl_trainer_engine", "tv_max", "max_abs_logprob_diff"))
    shifted = agreement(rows + 1e-7, rows)  # rows whose probabilities sum to a hair over one
    assert shifted["kl_engine_trainer"] >= 0 and shifted["kl_trainer_engine"] >= 0


def test_a_measure_past_its_bound_is_named_with_its_value_and_bound():
    figures = agreement(table([0.6, 0.4]), table([0.3, 0.7]))
    assert exceeded(agreement(table([0.6, 0.4]), table([0.6, 0.4])), "float32") == []
    failures = exceeded(figures, "bfloat16")
    assert f"tv_max=0.3 > {BOUNDS['bfloat16']['tv_max']:g}" in failures
    assert any(f.startswith("kl_engine_trainer=") for f in failures)


def test_several_trainer_ranks_are_refused_naming_the_key():
    with pytest.raises(SystemExit, match="trainer.world_size=2"):
        consistency.run_config(["trainer.world_size=2"])
    cfg = consistency.run_config(["model.dtype=bfloat16", "actor.use_kl_loss=true"])
    assert cfg.trainer.world_size == 1 and not cfg.actor.use_kl_loss  # the policy alone is loaded


def fake_certificate(setting: str, figures: dict) -> dict:
    return {
        "setting": setting,
        "model": "/models/tiny",
        "dtype": "bfloat16",
        "figures": figures,
        "bounds": BOUNDS["bfloat16"],
        "exceeded": exceeded(figures, "bfloat16"),
    }


def test_the_command_records_each_setting_once_and_fails_naming_the_measure(tmp_path, monkeypatch, capsys):
    good = agreement(table([0.6, 0.4]), table([0.6, 0.4]))
    bad = agreement(table([0.6, 0.4]), table([0.3, 0.7]))
    results = iter(
        [fake_certificate("bf16 a", good), fake_certificate("bf16 b", bad), fake_certificate("bf16 a", good)]
    )
    monkeypatch.setattr(consistency, "certify", lambda cfg, args: next(results))
    args = ["--out", str(tmp_path), "--name", "c"]
    assert consistency.main(args) == 0
    assert consistency.main(args) == 1
    assert "bf16 b: tv_max=0.3 > 0.2" in capsys.readouterr().err
    assert consistency.main(args) == 0  # the same setting again replaces its entry
    record = json.loads((tmp_path / "c.json").read_text())
    assert list(record["certificates"]) == ["bf16 a", "bf16 b"] and record["model"] == "tiny"
    report = (tmp_path / "c.md").read_text()
    assert "| bf16 a | 1 |" in report and "NO: " in report and report.count("| yes |") == 1


def test_the_engines_flat_logprobs_become_a_row_per_position_and_a_token_left_out_stays_minus_infinity():
    from vllm.logprobs import FlatLogprobs

    from rl_tpu.sampler.engine import EngineOptions, dense_rows, engine_args

    # vLLM's layout: no entry for the first token, then each position's tokens in rank order (the prompt's own first)
    flat = FlatLogprobs(
        start_indices=[0, 0, 3],
        end_indices=[0, 3, 5],
        token_ids=[2, 0, 1, 1, 0],
        logprobs=[-0.25, -3.0, -2.5, -1.0, -2.0],
    )
    rows = dense_rows(flat, vocab=3)
    assert rows.tolist() == [[-3.0, -2.5, -0.25], [-2.0, -1.0, float("-inf")]]
    assert engine_args(EngineOptions(full_distributions=True), None, True, [0])["max_logprobs"] == -1  # no cap
    assert "max_logprobs" not in engine_args(EngineOptions(), None, True, [0])  # a run's engines keep vLLM's
