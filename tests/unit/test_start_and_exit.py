"""A run's fixed costs at its end: the Ray cluster it started goes down with it, and the CLI's exit skips the
interpreter's last collections (benchmarks/startup.py measures both)."""

from __future__ import annotations

import gc

import pytest
import ray

from rl_tpu import main as cli_module
from rl_tpu.cluster import placement
from rl_tpu.config import RayConfig


@pytest.fixture
def fake_ray(monkeypatch):
    """Ray's start, stop and state, recorded instead of done."""
    calls, state = [], {"up": False}

    def init(**kwargs):
        calls.append(("init", kwargs["address"]))
        state["up"] = True

    def shutdown():
        calls.append(("shutdown", None))
        state["up"] = False

    monkeypatch.setattr(ray, "is_initialized", lambda: state["up"])
    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", shutdown)
    return calls, state


def test_the_cluster_a_run_started_is_shut_down_when_it_ends(fake_ray):
    calls, _ = fake_ray
    with placement.ray_for_run(RayConfig()):
        assert calls == [("init", "local")]
    assert calls == [("init", "local"), ("shutdown", None)]


def test_a_failed_run_shuts_its_cluster_down_too(fake_ray):
    calls, state = fake_ray
    with pytest.raises(RuntimeError, match="boom"), placement.ray_for_run(RayConfig()):
        raise RuntimeError("boom")
    assert calls[-1] == ("shutdown", None) and not state["up"]


def test_a_cluster_already_up_stays_up(fake_ray):
    """A sweep's trial and a test's `ray_cluster` run inside a cluster of their own: the run leaves it running."""
    calls, state = fake_ray
    state["up"] = True
    with placement.ray_for_run(RayConfig()):
        pass
    assert calls == [] and state["up"]


@pytest.mark.parametrize("outcome", [None, SystemExit(143)])
def test_the_cli_freezes_the_collector_before_the_interpreter_exits(monkeypatch, outcome):
    """After the run (or its stop with a signal's exit status) every object is frozen, so the interpreter's exit does
    not collect over torch's, vLLM's and Ray's modules (3-4 s of a short run's exit on a 2-core host)."""

    def run():
        if outcome is not None:
            raise outcome

    monkeypatch.setattr(cli_module, "main", run)
    monkeypatch.setattr("sys.argv", ["rl-tpu"])
    gc.unfreeze()
    try:
        if outcome is None:
            cli_module.cli()
        else:
            with pytest.raises(SystemExit):
                cli_module.cli()
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
