"""metrics.jsonl survives a crash in the middle of a write: a torn last line is dropped with a warning and the file
continues cleanly; a bad line anywhere else is an error naming the file and the line."""

from __future__ import annotations

import json
import logging

import pytest

from rl_tpu.outputs import rollout_log
from rl_tpu.outputs.metrics import MetricsLogger, read_metrics


def write_lines(path, rows, tail=""):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows) + tail)


def test_a_torn_last_line_is_dropped_with_a_warning_and_the_run_continues_the_file(tmp_path, caplog):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 0, "eval/accuracy": 0.5}, {"step": 1, "reward/mean": 0.25}], '{"step": 2, "rew')
    with caplog.at_level(logging.WARNING, logger="rl_tpu.outputs.metrics"):
        logger = MetricsLogger(tmp_path, total_steps=3, show_progress=False)
    assert [r["step"] for r in logger.records] == [0, 1]
    assert f"{path}: line 3 is torn" in caplog.text
    logger.truncate_after(1)  # what a resume does: the file is rewritten from the rows it kept
    logger.log(2, {"reward/mean": 0.5})
    logger.close()
    assert [r["step"] for r in read_metrics(path)] == [0, 1, 2]  # the new line is whole, on a line of its own


def test_a_bad_line_before_the_last_is_an_error_naming_it(tmp_path):
    path = tmp_path / "metrics.jsonl"
    write_lines(path, [{"step": 0}], '{"step": 1, "re\n{"step": 2}\n')
    with pytest.raises(ValueError, match=rf"{path}: line 2 is not a JSON object"):
        read_metrics(path)


def test_the_rollout_log_keeps_each_step_once_whole(tmp_path):
    folder = tmp_path / "rollouts"
    rollout_log.write_step(folder, 1, [{"index": 4, "score": 1.0}, {"index": 2, "score": 0.0}])
    rollout_log.write_step(folder, 2, [{"index": 7, "score": 0.5}])
    rollout_log.write_step(folder, 2, [{"index": 9, "score": 0.5}])  # a step trained again after a crash
    assert rollout_log.read_steps(folder) == {
        1: [{"index": 4, "score": 1.0, "step": 1}, {"index": 2, "score": 0.0, "step": 1}],
        2: [{"index": 9, "score": 0.5, "step": 2}],
    }
    assert sorted(p.name for p in folder.iterdir()) == ["1.jsonl", "2.jsonl"]  # no partial file left
