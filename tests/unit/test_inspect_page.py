"""The rollout inspector's data, short of a browser (tests/e2e/test_e2e.py and test_episodes_e2e.py open real runs'
pages in one): which samples a run records, what a recorded row holds, the trainer's per-token figures of the
recorded rows, the page's data from a record (the row cap among it) and the page's one file."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
from test_evaluation import Identity

from rl_tpu.config import RunConfig, TrainerConfig
from rl_tpu.controller.recording import Recorder, Trained, recorded_numbers, share
from rl_tpu.controller.rollouts import GradedBatch
from rl_tpu.data.datasets import Example
from rl_tpu.grader.grader import Grades
from rl_tpu.outputs import rollout_log
from rl_tpu.outputs.inspect import data, page
from rl_tpu.records import EpisodeStats, Rollout, TrainBatch
from rl_tpu.trainer.recorded import RecordedRows


class Pieces(Identity):
    """A tokenizer stand-in whose token `t` reads `<t>`."""

    def decode(self, ids, skip_special_tokens=False):
        return "".join(f"<{t}>" for t in ids)


def test_a_run_records_one_group_in_eight_unless_rollout_data_dir_asks_for_every_one():
    assert share(TrainerConfig()) == 8
    assert share(TrainerConfig(rollout_data_dir="/tmp/dump")) == 1  # verl's dump: every sample
    assert share(TrainerConfig(rollout_data_every=0)) == 0
    prompts = [Example([1], "src", "1", {}, row=row) for row in (16, 3, 8, 5)]
    rollouts = [Rollout([1], [2], [0.0], 0, "stop", group) for group in (0, 0, 1, 1, 2, 2, 3, 3)]
    graded = GradedBatch(prompts, rollouts, Grades([0.0] * 8, {}, {}))
    # the prompts whose row in the data file is a multiple of 8: the same prompt whenever it is drawn
    assert recorded_numbers(graded, 8) == [0, 1, -1, -1, 2, 3, -1, -1]
    assert recorded_numbers(graded, 1) == list(range(8))
    assert recorded_numbers(graded, 0) is None and recorded_numbers(graded, 32) is None  # none recorded


def test_a_negative_share_is_refused_naming_the_key():
    with pytest.raises(ValueError, match=r"trainer.rollout_data_every=-1"):
        TrainerConfig(rollout_data_every=-1)


def episode_batch() -> tuple[GradedBatch, TrainBatch]:
    """Two groups of two: an episode (model, tool, model) recorded, and single completions not recorded."""
    stats = EpisodeStats(turns=2, tool_calls={"calc": 1}, turn_starts=[0, 4], answer_end=6)
    stats.tool_turns = [[{"name": "calc", "status": "timeout"}]]
    episode = Rollout([1], [5, 6, 7, 8, 9, 9, 3, 4], [-0.5] * 8, 0, "stop", 0, [1, 1, 1, 1, 0, 0, 1, 1], stats)
    cut = Rollout([1], [5, 6], [-0.25, -0.125], 0, "length", 0, [1, 1], EpisodeStats(turns=1, truncated="max_tokens"))
    singles = [Rollout([2], [7], [-1.0], 0, "stop", 1), Rollout([2], [8], [-2.0], 0, "stop", 1)]
    prompts = [Example([1], "src", "7", {}, row=0), Example([2], "src", "8", {}, row=1)]
    grades = Grades([1.0, 0.0, 0.0, 1.0], {"acc": [1.0, 0.0, 0.0, 1.0]}, {})
    rollouts = [episode, cut, *singles]
    batch = TrainBatch(
        [r.prompt_ids for r in rollouts],
        [r.completion_ids for r in rollouts],
        [r.logprobs for r in rollouts],
        [[0.7] * 8, [-0.7] * 2, [-0.7], [0.7]],
        1.0,
        loss_mask=[True, False, True, True],  # the cut episode is out of the loss (overlong filtering)
        model_masks=[r.model_mask or [1] for r in rollouts],
    )
    return GradedBatch(prompts, rollouts, grades), batch


def test_a_recorded_training_row_holds_what_the_page_shows(tmp_path):
    graded, batch = episode_batch()
    recorder = Recorder(TrainerConfig(rollout_data_every=8), tmp_path, Pieces())
    batch = recorder.mark(graded, batch)
    assert batch.recorded == [0, 1, -1, -1]
    figures = {0: {"logprobs": [-0.4999999] * 8, "entropy": [1.23456] * 8}}  # none for row 1: the update skipped it
    recorder.write_train(3, Trained(graded, batch, figures))
    assert recorder.take_seconds() > 0.0 and recorder.take_seconds() == 0.0  # time/record_s, once
    first, second = rollout_log.read_steps(tmp_path / "rollouts")[3]
    assert first["output_pieces"] == ["<5>", "<6>", "<7>", "<8>", "<9>", "<9>", "<3>", "<4>"]
    assert first["loss_mask"] == [1, 1, 1, 1, 0, 0, 1, 1]  # the tool's tokens are out
    assert second["loss_mask"] == [0, 0]  # the whole sequence is out
    assert first["logprobs"] == [-0.5] * 8 and first["advantages"] == [0.7] * 8
    assert first["trainer_logprobs"] == [-0.5] * 8 and first["entropy"] == [1.2346] * 8  # rounded: 6 and 4 decimals
    assert "trainer_logprobs" not in second
    assert [t["role"] for t in first["turns"]] == ["model", "environment", "model"]
    assert first["turns"][1]["tools"] == [{"name": "calc", "status": "timeout"}]
    assert (first["split"], first["group"], first["index"], first["step"]) == ("train", 0, 0, 3)
    assert first["reward_parts"] == {"acc": 1.0} and second["truncated"] == "max_tokens"
    assert second["finish_reason"] == "length"


def test_the_trainers_figures_are_asked_for_only_when_a_row_is_recorded(tmp_path):
    class Trainers:
        calls = 0

        def recorded_figures(self):
            self.calls += 1
            return {0: {"logprobs": [-1.0], "entropy": [0.5]}}

    graded, batch = episode_batch()
    trainers, recorder = Trainers(), Recorder(TrainerConfig(rollout_data_every=8), tmp_path, Pieces())
    assert recorder.take_figures(trainers, batch) == {} and trainers.calls == 0  # nothing marked
    assert recorder.take_figures(trainers, recorder.mark(graded, batch))[0]["entropy"] == [0.5]
    assert trainers.calls == 1


def test_an_evaluation_records_the_greedy_samples_of_the_same_share_of_prompts(tmp_path):
    prompts = [Example([1], "src", str(row), {}, row=row) for row in range(10)]
    greedy = [Rollout([1], [row], [0.0], 0, "stop", row) for row in range(10)]
    graded = GradedBatch(prompts, greedy, Grades([1.0] * 10, {"acc": [1.0] * 10}, {}))
    Recorder(TrainerConfig(rollout_data_every=4), tmp_path, Pieces()).write_eval(0, graded)
    rows = rollout_log.read_steps(tmp_path / "rollouts" / "eval")[0]
    assert [r["index"] for r in rows] == [0, 4, 8] and {r["split"] for r in rows} == {"eval"}
    assert "loss_mask" not in rows[0] and "logprobs" not in rows[0]  # greedy, not trained on
    Recorder(TrainerConfig(rollout_data_every=0), tmp_path / "off", Pieces()).write_eval(0, graded)
    assert not (tmp_path / "off").exists()


def test_the_trainer_keeps_the_recorded_rows_figures_and_reads_them_once():
    rows = RecordedRows()
    micro = TrainBatch(
        [[1]] * 3, [[1, 2], [3], [4, 5, 6]], [[0.0] * 2, [0.0], [0.0] * 3], [[0.0] * 2, [0.0], [0.0] * 3], 1.0
    )
    micro.recorded = [4, -1, 0]
    logprobs = torch.tensor([[-1.0, -2.0, 0.0], [-3.0, 0.0, 0.0], [-4.0, -5.0, -6.0]])
    rows.keep(micro, logprobs, -logprobs)
    taken = rows.take()
    assert taken == {
        4: {"logprobs": [-1.0, -2.0], "entropy": [1.0, 2.0]},
        0: {"logprobs": [-4.0, -5.0, -6.0], "entropy": [4.0, 5.0, 6.0]},
    }
    assert rows.take() == {}  # taken once


def test_the_trainers_recorded_logprobs_are_those_its_logprob_gap_metric_reads(tiny_model_dir):
    from conftest import free_port, make_batch
    from test_host_syncs import ScalarReads

    from rl_tpu.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.device, cfg.trainer.micro_batch_size, cfg.trainer.skip_zero_advantage_rows = "cpu", 3, False
    batch = make_batch(seed=3, size=8)
    batch.recorded = [0, 1, 2, 3, 4, 5, 6, 7]  # sorted by length and cut into micro-batches on the way
    worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        with ScalarReads() as counted:
            metrics = worker.train_step(batch)
        taken = worker.take_recorded()
    finally:
        worker.shutdown()
    assert counted.ours == 1  # the gradient norm only: the figures wait on the device for the driver
    assert sorted(taken) == list(range(8))
    gaps = [abs(t - s) for i in range(8) for t, s in zip(taken[i]["logprobs"], batch.sampler_logprobs[i])]
    assert [len(taken[i]["entropy"]) for i in range(8)] == [len(c) for c in batch.completion_ids]
    assert sum(gaps) / len(gaps) == pytest.approx(metrics["actor/logprob_diff"], rel=1e-5)
    assert max(gaps) == pytest.approx(metrics["actor/logprob_diff_max"], rel=1e-5)


def record_row(step: int, group: int, tokens: int, **fields) -> dict:
    return {"step": step, "group": group, "index": group, "output_ids": list(range(tokens)), **fields}


def test_the_cap_keeps_whole_groups_round_robin_over_the_steps():
    record = {("train", step): [record_row(step, g, 10) for g in range(3) for _ in range(2)] for step in (1, 2, 3)}
    record[("eval", 0)] = [record_row(0, i, 10) for i in range(4)]
    kept, left_out = data.cap(record, max_rows=13, max_tokens=10_000)
    # rounds of one group a step: eval 0 (1 row), steps 1, 2, 3 (2 rows each): 7 rows; then 1 + 2 + 2 (step 3's
    # group of 2 does not fit in the 1 row left: step 3 is full), then the evaluation's last row
    assert [len(kept[key]) for key in sorted(kept)] == [3, 4, 4, 2] and left_out == 22 - 13
    assert all(len({r["group"] for r in rows}) * 2 == len(rows) for key, rows in kept.items() if key[0] == "train")
    kept, left_out = data.cap(record, max_rows=10_000, max_tokens=50)  # 5 rows of 10 tokens
    assert sum(map(len, kept.values())) == 5 and left_out == 17
    assert data.cap(record, 10_000, 10_000) == (record, 0)


def write_run(folder, rows_by_step: dict[int, list[dict]], evals: dict[int, list[dict]], metrics: list[dict]):
    for step, rows in rows_by_step.items():
        rollout_log.write_step(folder / "rollouts", step, rows)
    for step, rows in evals.items():
        rollout_log.write_step(folder / "rollouts" / "eval", step, rows)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))


def test_the_page_data_from_a_record(tmp_path):
    train = [
        record_row(1, 0, 3, output_pieces=["a", "b", "c"], loss_mask=[1, 1, 0], advantages=[0.5, 0.5, 0.5],
                   logprobs=[-1.0, -2.0, -3.0], trainer_logprobs=[-1.0, -2.5, -3.0], score=1.0, finish_reason="stop",
                   turns=[{"role": "model", "start": 0, "end": 2},
                          {"role": "environment", "start": 2, "end": 3, "tools": [{"name": "calc", "status": "ok"}]}]),
        record_row(1, 0, 2, score=float("nan"), finish_reason="length", outcome="truncated"),
    ]  # fmt: skip
    metrics = [{"step": 0, "eval/accuracy": 0.25}, {"step": 1, "reward/mean": 0.5}, {"step": 2, "reward/mean": 0.75}]
    write_run(tmp_path, {1: train}, {0: [record_row(0, 7, 1, score=0.0)]}, metrics)
    made = data.run_data(tmp_path)
    assert [s["step"] for s in made["steps"]] == [0, 1, 2]  # every step, recorded or not
    assert made["steps"][1] == {
        "step": 1, "reward": 0.5, "accuracy": None, "counted_by": "outcome", "counts": {"None": 1, "truncated": 1},
        "train": 2, "eval": 0,
    }  # fmt: skip
    evaluation, first, second = made["samples"]
    assert evaluation["split"] == "eval" and evaluation["index"] == 7
    assert first["tokens"] == ["a", "b", "c"] and first["mask"] == [1, 1, 0] and first["tool_calls"] == 1
    assert first["advantage"] == 0.5 and first["tlp"] == [-1.0, -2.5, -3.0] and first["truncated"] is None
    assert second["reward"] is None and second["truncated"] == "length"  # NaN: JSON's null
    json.dumps(made, allow_nan=False)


def test_the_page_is_one_file_whose_data_no_sample_text_can_break_out_of(tmp_path):
    hostile = "</script><script>alert(1)</script><!-- & "
    write_run(tmp_path, {1: [record_row(1, 0, 1, output=hostile, output_pieces=[hostile])]}, {}, [{"step": 1}])
    html = page.write_page(tmp_path).read_text()
    assert html.count("</script>") == 2 and "/*DATA*/" not in html and "/*SCRIPT*/" not in html
    embedded = html.split('id="inspect-data">', 1)[1].split("</script>", 1)[0]
    assert not {"<", ">", "&"} & set(embedded)  # no `</script`, `<!--` or character reference can start in it
    assert json.loads(embedded)["samples"][0]["output"] == hostile
    assert (
        "<link" not in html and "src=" not in html and "http" not in html.replace("http-equiv", "")
    )  # nothing fetched


def test_rl_tpu_inspect_writes_the_page_and_prints_where(tmp_path, monkeypatch, capsys):
    from rl_tpu.main import cli

    write_run(tmp_path, {}, {}, [{"step": 0, "eval/accuracy": 0.5}])
    monkeypatch.setattr(sys, "argv", ["rl-tpu", "inspect", str(tmp_path)])
    cli()
    assert capsys.readouterr().out.strip() == str(tmp_path / "inspect.html")
    monkeypatch.setattr(sys, "argv", ["rl-tpu", "inspect"])
    with pytest.raises(SystemExit, match="usage: rl-tpu inspect RUN_FOLDER"):
        cli()


def test_non_finite_figures_become_null():
    assert data.finite({"a": [1.0, math.inf, {"b": -math.inf}], "c": math.nan}) == {
        "a": [1.0, None, {"b": None}],
        "c": None,
    }
