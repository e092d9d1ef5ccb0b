"""The preflight's run: the run's own settings and machinery (rl_tpu/controller/run.py's `run`) for two short steps,
watched (`DoctorWatch`), then every check of `checks` on what it showed, written to OUT/doctor.json.

What the short run changes, and why (`doctor_config`): 2 steps (step 2 trains on the rollouts of the weights step 1
synced, so the logprob gap checks a sync too); at most `DOCTOR_PROMPTS` prompts a step; one held-out prompt; no
checkpoint, export, plots, trackers or restarts. Everything else, the model, data, reward, sampler, loss, device and
transport, is the run's.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

from rl_tpu.config import RunConfig, Tracker
from rl_tpu.config.choices import ResumeMode
from rl_tpu.controller.recovery import RunInterrupted
from rl_tpu.controller.rollouts import GradedBatch
from rl_tpu.controller.run import run
from rl_tpu.controller.watch import RunWatch
from rl_tpu.data.datasets import Example
from rl_tpu.doctor import checks
from rl_tpu.doctor.checks import FAILED, PASSED, Check, unavailable
from rl_tpu.grader.grader import Grader, Grades, Sample

log = logging.getLogger(__name__)

DOCTOR_STEPS = 2
DOCTOR_PROMPTS = 8  # prompts a step at most: with sampler.n each, enough groups for some to vary
REWARD_ROWS = 4  # training rows the reward scores before any engine starts
REPORT_FILE = "doctor.json"
# each sample a reward scores per row: (what it is, its text from the row's reference answer)
REWARD_COMPLETIONS = (("the reference answer", str), ("an empty completion", lambda truth: ""))


def doctor_batch(cfg: RunConfig) -> int:
    """The fewest prompts from min(run's batch, `DOCTOR_PROMPTS`) up that the ranks and mini-batches divide."""
    batch, n, ranks = cfg.data.train_batch_size, cfg.sampler.n, cfg.trainer.world_size
    mini = cfg.actor.ppo_mini_batch_size
    for size in range(min(batch, DOCTOR_PROMPTS), batch):
        if (size * n) % ranks == 0 and (mini is None or size % mini == 0):
            return size
    return batch


def doctor_config(cfg: RunConfig) -> RunConfig:
    """The run's settings for the preflight's short run (the module's docstring says what changes)."""
    short = copy.deepcopy(cfg)
    t = short.trainer
    t.total_steps = t.eval_every = DOCTOR_STEPS
    t.eval_pass_k, t.checkpoint_every, t.checkpoint_final = 0, 0, False
    t.export, t.push_to_hub, t.plots, t.logger, t.rollout_data_dir = False, None, False, [Tracker.jsonl], None
    t.resume, t.resume_from, t.max_restarts, t.preflight = ResumeMode.off, None, 0, False
    short.data.val_max_samples = 1
    short.data.train_batch_size = doctor_batch(cfg)
    return short


def reward_samples(examples: list[Example], episodes: bool) -> tuple[list[str], list[Sample]]:
    """Per row, its reference answer as a completion and an empty completion (`REWARD_COMPLETIONS`), each named by
    its row; an episode's reward also finds the completion as a one-turn episode (`extra_info["episode"]`)."""
    labels, samples = [], []
    for example in examples:
        for what, text_of in REWARD_COMPLETIONS:
            text, extra_info = text_of(example.ground_truth), example.extra_info
            if episodes:
                turn = {"role": "model", "text": text}
                extra_info = {**extra_info, "episode": {"text": text, "turns": [turn], "truncated": None}}
            labels.append(f"row {example.row} ({what})")
            samples.append(Sample(example.data_source, text, example.ground_truth, extra_info))
    return labels, samples


def score_rows(cfg: RunConfig, samples: list[Sample], log_dir: str | None) -> Grades:
    """The samples graded as the run grades (reward worker processes, `reward.timeout_s`), by one worker that counts
    every failure rather than stopping at `reward.max_failure_rate`."""
    reward = dataclasses.replace(cfg.reward, num_workers=1, max_failure_rate=1.0)
    grader = Grader(reward, cfg.custom_reward_function, log_dir)
    try:
        return grader.grade(samples)
    finally:
        grader.close()


def reward_keys(cfg: RunConfig) -> str:
    """The keys that choose the reward that failed: the plugin's file and function, or the built-in's name."""
    if cfg.reward.custom.path or cfg.custom_reward_function.path:
        return "reward.custom.path and reward.custom.name (or custom_reward_function.*): the plugin's code"
    return "reward.name, reward.combine"


class DoctorWatch(RunWatch):
    """Reads the short run: the checks of its inputs before any engine starts, then each step's metrics and groups."""

    def __init__(self, cfg: RunConfig, log_dir: Path):
        self.cfg, self.log_dir = cfg, log_dir
        self.started = False  # whether the run got past its own checks to show its inputs
        self.inputs_s = 0.0  # what the checks of the inputs took (the reward worker's start included)
        self.before: dict[str, Check] = {}
        self.tools: tuple | None = None  # what the tool-call check reads of the inputs: tokenizer, schemas, a prompt
        self.metrics: list[dict[str, Any]] = []
        self.groups: list[list[float]] = []

    def inputs(self, tokenizer: Any, examples: list[Example], tools: list[dict] | None) -> None:
        self.started, started = True, time.monotonic()
        rows = examples[:REWARD_ROWS]
        self.before["chat template"] = checks.chat_template(tokenizer, [e.prompt_ids for e in rows])
        self.tools = (tokenizer, tools, rows[0].prompt_ids)
        labels, samples = reward_samples(rows, self.cfg.episode.enable)
        grades = score_rows(self.cfg, samples, str(self.log_dir))
        self.before["reward plugin"] = checks.reward_plugin(
            labels, grades.scores, grades.failures, reward_keys(self.cfg)
        )
        self.inputs_s = time.monotonic() - started

    def step(self, step: int, metrics: dict[str, float], batch: GradedBatch) -> None:
        self.metrics.append(dict(metrics))
        self.groups += [[batch.grades.scores[i] for i in rows] for rows in batch.groups().values()]

    def report(self) -> list[Check]:
        """Every check, in the order docs/preflight.md lists them."""
        cfg, metrics = self.cfg, self.metrics
        variance = checks.reward_variance(self.groups)
        return [
            self._before("chat template"),
            checks.eos_reachable(metrics, cfg.completion_tokens, cfg.completion_keys),
            variance,
            checks.gradient(metrics, variance.status == PASSED),
            checks.canary(metrics, cfg.model.dtype, cfg.sync.canary.max_gap),
            self._tool_calls(),
            checks.logprob_gap(metrics, cfg.model.dtype, cfg.actor.old_logprob_source),
            self._before("reward plugin"),
        ]

    def _tool_calls(self) -> Check:
        parser = self.cfg.episode.tool_parser if self.cfg.episode.enable else None
        if self.tools is None and parser is not None:
            return self._before("tool calls")
        return checks.tool_calls(parser, *(self.tools or (None, None, [])), self.metrics)

    def _before(self, name: str) -> Check:
        return self.before.get(name) or unavailable(name, "it could not run: the short run stopped (above)")


@dataclasses.dataclass
class Report:
    checks: list[Check]
    error: str | None  # why the short run stopped early, if it did
    steps: int
    wall_s: float
    inputs_s: float = 0.0  # of wall_s, the checks of the inputs; the rest is the short run's

    @property
    def passed(self) -> bool:
        return self.error is None and all(c.status != FAILED for c in self.checks)

    def lines(self) -> list[str]:
        stopped = [f"{'steps':<17} {FAILED}: the short run stopped: {self.error}"] if self.error else []
        verdict = "passed" if self.passed else "FAILED"
        return [
            *stopped,
            *(c.line() for c in self.checks),
            f"doctor: {verdict} ({self.steps} steps, {self.wall_s:.0f} s)",
        ]

    def write(self, path: Path) -> None:
        record = {
            "passed": self.passed,
            "error": self.error,
            "steps": self.steps,
            "wall_s": round(self.wall_s, 1),
            "inputs_s": round(self.inputs_s, 2),
            "checks": [dataclasses.asdict(c) for c in self.checks],
        }
        path.write_text(json.dumps(record, indent=2) + "\n")


def diagnose(cfg: RunConfig, out_dir: Path) -> Report:
    """The short run of `cfg`'s settings in `out_dir`, then every check; the report is written to OUT/doctor.json.
    Settings the run's own checks refuse raise as they would for the run (nothing was checked yet)."""
    started = time.monotonic()
    watch, error = DoctorWatch(cfg, out_dir / "logs"), None
    try:
        run(doctor_config(cfg), out_dir, show_progress=False, watch=watch)
    except RunInterrupted:
        raise
    except Exception as failed:  # what stopped the short run is the first thing the report names
        if not watch.started:  # the run's own checks refused the settings: the error a run of them gets
            raise
        log.warning("the short run stopped after %d step(s)", len(watch.metrics), exc_info=True)
        error = f"{type(failed).__name__}: {failed}"
    report = Report(watch.report(), error, len(watch.metrics), time.monotonic() - started, watch.inputs_s)
    out_dir.mkdir(parents=True, exist_ok=True)
    report.write(out_dir / REPORT_FILE)
    return report


class PreflightFailed(RuntimeError):
    """A check of `trainer.preflight` failed: the run does not start."""


def preflight(cfg: RunConfig, folder: Path) -> Report:
    """`trainer.preflight=true`: the doctor's short run in `folder` (its own run folder, so the run's outputs and its
    start weights are untouched), before the run; raises `PreflightFailed` naming each failure."""
    log.info("preflight: %d short steps of this run's settings in %s", DOCTOR_STEPS, folder)
    report = diagnose(cfg, folder)
    for line in report.lines():
        log.info("preflight: %s", line)
    if not report.passed:
        failed = [line for line in report.lines() if f" {FAILED}: " in line]
        raise PreflightFailed(
            f"the preflight failed, so the run did not start ({folder / REPORT_FILE}; trainer.preflight=false skips "
            "it):\n  " + "\n  ".join(failed)
        )
    return report
