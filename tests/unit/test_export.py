"""The export's model card and its optional push to the Hub (which fails soft: here the Hub is offline)."""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
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


class StandInHub:
    """huggingface_hub.HfApi's calls that push_to_hub makes, against a dict of repositories {id: private}."""

    repos: dict[str, bool] = {}
    uploads: list[str] = []

    def repo_exists(self, repo_id):
        return repo_id in self.repos

    def repo_info(self, repo_id):
        return SimpleNamespace(private=self.repos[repo_id])

    def create_repo(self, repo_id, private):
        self.repos[repo_id] = private

    def upload_folder(self, repo_id, folder_path, commit_message):
        assert "/" not in commit_message  # no local path leaves the machine in the commit either
        self.uploads.append(repo_id)


@pytest.fixture
def hub(monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "HfApi", StandInHub)
    StandInHub.repos, StandInHub.uploads = {"me/open": False, "me/closed": True}, []
    return StandInHub


def test_a_public_repository_is_refused_unless_asked_and_a_new_one_is_private(tmp_path, hub, caplog):
    with caplog.at_level(logging.WARNING, logger="rl_tpu.outputs.export"):
        assert push_to_hub(tmp_path, "me/open") is False
    assert hub.uploads == [] and "the repository is public (export.public=true" in caplog.text
    assert push_to_hub(tmp_path, "me/open", public=True) and push_to_hub(tmp_path, "me/closed")
    assert push_to_hub(tmp_path, "me/new") and hub.repos["me/new"] is True
    assert hub.uploads == ["me/open", "me/closed", "me/new"]


def test_the_model_card_names_no_local_path(tmp_path):
    run = fake_run(tmp_path)
    overrides = ["+recipe=grpo_gsm8k", f"model.path={tmp_path}/models/Qwen", "data.train_files=~/data/train.parquet"]
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    write_model_card(tmp_path, run, "float32")
    card = (tmp_path / "README.md").read_text()
    assert str(tmp_path) not in card and "~/" not in card and "/root" not in card and "/home" not in card
    assert "model.path=.../Qwen data.train_files=.../train.parquet" in card and "run folder: `run`" in card


ABSOLUTE_OR_HOME = re.compile(r"(?<![\w.:/-])(?:~[\w.-]*)?/[\w.-]+/")  # /a/..., ~/a/..., ~user/a/...


@pytest.mark.parametrize(
    "model, name",
    [
        ("hub/models--Qwen--Qwen2.5-0.5B/snapshots/0123abc", "Qwen/Qwen2.5-0.5B"),
        ("models/tiny_arith-1a2b", "tiny_arith-1a2b"),
    ],
    ids=["a Hub download", "a local folder"],
)
def test_an_exported_adapter_names_its_base_and_no_file_holds_a_local_path(tmp_path, model, name):
    """adapter_config.json gives the base's Hub name, else its folder's name (a pushed folder is uploaded as it
    is), and neither it, the weights' header nor the card holds an absolute or home path."""
    from rl_tpu.trainer.lora import write_adapter_folder

    model_path, export = tmp_path / model, tmp_path / "export"
    tensors = {"base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight": torch.zeros(8, 16)}
    write_adapter_folder(tensors, {"peft_type": "LORA", "r": 8}, str(model_path), export)
    run = fake_run(tmp_path)
    overrides = [f"model.path={model_path}", f"data.train_files=[{tmp_path}/a.jsonl,~/data/b.jsonl]"]
    (run / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    write_model_card(export, run, "float32", adapter=True)
    assert json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"] == name
    assert sorted(p.name for p in export.iterdir()) == ["README.md", "adapter_config.json", "adapter_model.safetensors"]
    for file in export.iterdir():
        text = file.read_bytes().decode("utf-8", errors="replace")
        assert str(tmp_path) not in text and str(Path.home()) not in text, file.name
        assert not ABSOLUTE_OR_HOME.findall(text), (file.name, ABSOLUTE_OR_HOME.findall(text))
    assert "data.train_files=[.../a.jsonl,.../b.jsonl]" in (export / "README.md").read_text()
