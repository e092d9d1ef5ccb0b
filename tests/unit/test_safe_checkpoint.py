"""A checkpoint is read as data: its metadata and its non-tensor items cannot run code, and a real checkpoint
still loads exactly. Each crafted checkpoint is first shown to run its code through DCP's own loader."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys

import pytest
import torch
import torch.distributed.checkpoint as dcp
from conftest import REPO

from rl_tpu.models.safe_checkpoint import UnsafeCheckpointError, check_metadata, load_state


class CreatesAFile:
    """Unpickling this object creates the file `path`: what a malicious checkpoint would do."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return (exec, (f"open({self.path!r}, 'w').write('ran')",))


def training_state(extra=None) -> dict:
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
    scheduler.step()
    state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "scheduler": scheduler.state_dict()}
    if extra is not None:
        state["scheduler"]["extra"] = extra
    return state


def save(folder, state) -> None:
    dcp.save(state, checkpoint_id=str(folder), no_dist=True)


def safe_load(folder, state) -> None:
    load_state(state, folder, no_dist=True)


def test_a_real_checkpoint_loads_exactly_through_the_safe_reader(tmp_path):
    saved = training_state()
    save(tmp_path / "step_1", saved)
    empty = training_state()
    empty["model"] = {k: torch.zeros_like(v) for k, v in empty["model"].items()}
    empty["scheduler"] = {k: None for k in saved["scheduler"]}
    safe_load(tmp_path / "step_1", empty)
    for name, tensor in saved["model"].items():
        assert torch.equal(empty["model"][name], tensor), name
    assert empty["scheduler"] == saved["scheduler"]
    assert set(check_metadata(tmp_path / "step_1").state_dict_metadata) >= {"model.weight", "model.bias"}


def test_metadata_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    folder, marker = tmp_path / "step_1", tmp_path / "ran"
    save(folder, training_state())
    (folder / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
    with pytest.raises(Exception):  # the crafted file is real: DCP's own reader runs it
        dcp.FileSystemReader(str(folder)).read_metadata()
    assert marker.exists()
    marker.unlink()
    with pytest.raises(UnsafeCheckpointError, match=r"\.metadata: refused: it asks for builtins\.exec"):
        check_metadata(folder)
    assert not marker.exists()


def test_a_non_tensor_item_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
    folder, marker = tmp_path / "step_1", tmp_path / "ran"
    save(folder, training_state(extra=CreatesAFile(marker)))
    dcp.load(training_state(extra=0), checkpoint_id=str(folder), no_dist=True)  # DCP's own loader runs it
    assert marker.exists()
    marker.unlink()
    with pytest.raises(
        UnsafeCheckpointError,
        match=r"'scheduler.extra' refused: it is not plain data \(Unsupported global: GLOBAL exec\); loading it could",
    ):
        safe_load(folder, training_state(extra=0))
    assert not marker.exists()


def test_the_export_cli_refuses_a_crafted_checkpoint_before_it_runs(tmp_path):
    folder, marker = tmp_path / "run" / "checkpoints" / "step_1", tmp_path / "ran"
    save(folder, training_state())
    (folder / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
    result = subprocess.run(
        [sys.executable, "-m", "rl_tpu.export", str(folder), str(tmp_path / "out")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert result.returncode != 0 and "refused: it asks for builtins.exec" in result.stderr, result.stderr[-2000:]
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_resume_from_a_crafted_checkpoint_is_refused_at_start(tmp_path):
    from conftest import compose_run

    from rl_tpu.controller.checks import validate

    folder, marker = tmp_path / "run" / "checkpoints" / "step_4", tmp_path / "ran"
    save(folder, training_state())
    validate(compose_run(f"trainer.resume_from={folder}"))  # the real checkpoint passes
    (folder / ".metadata").write_bytes(pickle.dumps(CreatesAFile(marker)))
    with pytest.raises(UnsafeCheckpointError, match=rf"{folder}/\.metadata: refused"):
        validate(compose_run(f"trainer.resume_from={tmp_path / 'run'}"))  # a run folder: its newest checkpoint
    assert not marker.exists()
