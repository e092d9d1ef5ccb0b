"""A run trains with a transport defined outside rl_tpu (tests/fixtures/handshake_transport.py), named by import path:
the controller runs its handshake, the engines attach it, and every sync goes through it."""

from __future__ import annotations

import os

import pytest
from conftest import REPO, run_cli

from rl_tpu.outputs.metrics import read_metrics

pytestmark = pytest.mark.e2e

PLUGIN = "handshake_transport:HandshakeStore"


def test_a_run_syncs_through_a_transport_from_a_module_of_its_own(tmp_path, monkeypatch):
    # the module importable in the driver and, through the environment Ray's workers inherit, in every actor
    path = [str(REPO / "tests" / "fixtures"), *filter(None, [os.environ.get("PYTHONPATH")])]
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    run_cli(tmp_path / "run", tmp_path / "cache", f"sync.transport={PLUGIN}", "trainer.total_steps=2")
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2]
    for step, row in enumerate(rows[1:], start=1):  # an engine refuses a bucket that skipped a hook
        assert row["sync/transport"] == PLUGIN and row["sync/version"] == step and row["sync/bytes"] > 0
