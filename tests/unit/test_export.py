"""The export's model card and its optional push to the Hub (which fails soft: here the Hub is offline)."""

from __future__ import annotations

import json
import logging

import yaml

from rl_tpu.outputs.export import push_to_hub, write_model_card


def test_an_offline_push_is_one_warning_and_the_export_stays(tmp_path, caplog, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    (tmp_path / "config.json").write_text("{}")
    with caplog.at_level(logging.WARNING, logger="rl_tpu.outputs.export"):
        assert push_to_hub(tmp_path, "me/policy") is False
    (record,) = caplog.records
    assert record.getMessage().startswith("push to hub me/policy failed (OfflineModeIsEnabled")
    assert f"the export stays in {tmp_path}" in record.getMessage() and (tmp_path / "config.json").is_file()


def fake_run(tmp_path):
    run = tmp_path / "run"
    (run / ".hydra").mkdir(parents=True)
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["+recipe=grpo_math", "algorithm.lr=3e-5"]))
    rows = [{"step": 0, "eval/accuracy": 0.5}, {"step": 10, "eval/accuracy": 0.7}, {"step": 20, "eval/accuracy": 0.9}]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return run


def test_the_model_card_gives_the_recipe_the_accuracy_and_the_command(tmp_path):
    write_model_card(tmp_path, fake_run(tmp_path), "bfloat16")
    card = (tmp_path / "README.md").read_text()
    assert "recipe: `grpo_math`; exported from the end of the run (step 20), weights in bfloat16" in card
    assert "50.0% before training -> 80.0% after" in card
    assert "rl-tpu +recipe=grpo_math algorithm.lr=3e-5" in card


def test_a_mid_run_card_reports_what_the_policy_had_reached_at_its_step(tmp_path):
    write_model_card(tmp_path, fake_run(tmp_path), "float32", step=10, source="checkpoint step_10")
    card = (tmp_path / "README.md").read_text()
    assert "exported from checkpoint step_10 (step 10)" in card and "50.0% before training -> 70.0% after" in card
