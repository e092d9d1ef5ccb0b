"""Trackers through verl's Tracking: TensorBoard files in the run folder, and soft failures that cost one warning."""

from __future__ import annotations

import importlib.util
import logging
import os

import pytest
from conftest import tensorboard_scalars

from rl_tpu.outputs.tracking import Trackers, environment_defaults, scalars


def test_tensorboard_gets_the_numeric_metrics_and_the_config(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    trackers = Trackers(["console", "jsonl", "tensorboard"], tmp_path, "p", "e", {"trainer": {"total_steps": 2}})
    trackers.log(1, {"reward/mean": 0.25, "sync/transport": "object_store", "actor/skipped": 0, "flag": True})
    trackers.log(2, {"reward/mean": 0.5})
    trackers.close()
    assert tensorboard_scalars(tmp_path / "tensorboard") == {
        "reward/mean": {1: 0.25, 2: 0.5},
        "actor/skipped": {1: 0.0},
    }
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    (text,) = events.Tensors("config/text_summary")
    assert b"total_steps: 2" in text.tensor_proto.string_val[0]


@pytest.mark.parametrize("name, package", [("wandb", "wandb"), ("mlflow", "mlflow"), ("trackio", "trackio")])
def test_a_tracker_whose_package_is_missing_costs_one_warning(tmp_path, caplog, name, package):
    if importlib.util.find_spec(package):
        pytest.skip(f"{package} is installed")
    with caplog.at_level(logging.WARNING, logger="rl_tpu.outputs.tracking"):
        trackers = Trackers([name], tmp_path, "p", "e", {})
        trackers.log(1, {"reward/mean": 1.0})
        trackers.close()
    assert [r.getMessage() for r in caplog.records] == [
        f"trainer.logger: {name} is not installed (No module named '{package}'); the run goes on without it"
    ]


def test_a_tracker_that_fails_mid_run_is_dropped_with_one_warning(tmp_path, caplog):
    trackers = Trackers(["tensorboard"], tmp_path, "p", "e", {})

    class Broken:
        def log(self, data, step):
            raise ConnectionError("server went away")

        def finish(self):
            pass

    trackers.backends["broken"] = Broken()
    with caplog.at_level(logging.WARNING, logger="rl_tpu.outputs.tracking"):
        trackers.log(1, {"reward/mean": 1.0})
        trackers.log(2, {"reward/mean": 1.0})
    trackers.close()
    assert [r.getMessage() for r in caplog.records] == [
        "trainer.logger: broken failed at step 1 (ConnectionError: server went away); no more metrics go to it"
    ]
    assert tensorboard_scalars(tmp_path / "tensorboard") == {"reward/mean": {1: 1.0, 2: 1.0}}


def test_local_files_go_into_the_run_folder_unless_the_user_said_otherwise(monkeypatch):
    monkeypatch.setenv("WANDB_DIR", "/mine")
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    with environment_defaults({"WANDB_DIR": "/run", "TENSORBOARD_DIR": "/run/tb"}):
        assert os.environ["WANDB_DIR"] == "/mine" and os.environ["TENSORBOARD_DIR"] == "/run/tb"
    assert os.environ["WANDB_DIR"] == "/mine" and "TENSORBOARD_DIR" not in os.environ  # the next trial sets its own


def test_only_numbers_reach_the_trackers():
    assert scalars({"a": 1, "b": 2.5, "c": "x", "d": True, "e": None}) == {"a": 1.0, "b": 2.5}
