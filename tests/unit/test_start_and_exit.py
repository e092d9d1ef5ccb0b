"""A run's fixed cost at its end: the CLI's exit skips the interpreter's last collections
(benchmarks/startup.py measures it)."""

from __future__ import annotations

import gc

import pytest

from rl_tpu import main as cli_module


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
