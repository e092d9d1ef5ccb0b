"""The recipes' seed studies: a run counts as finished only once its last evaluation is in; the table's rows."""

from __future__ import annotations

import json

from rl_tpu.outputs.seed_runs import finished, markdown_table


def test_a_run_is_finished_once_its_last_evaluation_is_in(tmp_path):
    assert not finished(tmp_path, 2)
    records = [{"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.6}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert not finished(tmp_path, 2)  # the last step, but not its evaluation
    records.append({"step": 2, "eval/accuracy": 0.7})
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    assert finished(tmp_path, 2) and not finished(tmp_path, 3) and not finished(tmp_path, 2, "eval/pass@1")


def test_the_table_has_each_variants_mean_then_its_seeds():
    table = markdown_table({"a": {0: {"win": 1.0}, 2: {"win": 0.5}}, "b": {}})
    assert table.splitlines() == [
        "| run | win |",
        "|---|---|",
        "| a, mean of 2 | 0.750 |",
        "| a, seed 0 | 1.000 |",
        "| a, seed 2 | 0.500 |",
    ]
