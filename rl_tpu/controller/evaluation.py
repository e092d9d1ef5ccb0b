"""Held-out evaluation: greedy accuracy at every evaluation, and pass@k from samples at the first and the last.

Greedy accuracy says what the policy's most likely answer is worth; pass@k at the sampling temperature
says what its distribution holds (RL is often said to sharpen pass@1 at the expense of pass@k). The
k samples of each prompt are seeded from `sampler.seed` and the prompt alone, so the first and the last
evaluation draw with the same seeds and a resumed run repeats them.
"""

from __future__ import annotations

import math
import statistics
import time
from dataclasses import dataclass

from rl_tpu.config import RunConfig
from rl_tpu.controller.rollouts import GradedBatch, episode_metrics, grade, sampling_seed
from rl_tpu.data.datasets import Example
from rl_tpu.grader.grader import Grader, Grades
from rl_tpu.sampler.engine import SamplingSettings
from rl_tpu.sampler.pool import PendingRollouts, SamplerPool

EVAL_BATCH = 0  # the generation-batch number of the evaluation's draws: training batches count from 1


def pass_at_k(n: int, correct: int, k: int) -> float:
    """The unbiased estimator of Chen et al. (2021): the chance that k of the n samples, drawn without
    replacement, include a correct one."""
    if not 0 < k <= n:
        raise ValueError(f"pass@{k} needs 1 <= k <= n = {n} samples")
    return 1.0 if n - correct < k else 1.0 - math.comb(n - correct, k) / math.comb(n, k)


def reported_ks(k: int) -> list[int]:
    """The k of pass@k reported for k samples a prompt: powers of two up to k, and k."""
    return sorted({2**i for i in range(k.bit_length()) if 2**i <= k} | {k})


@dataclass
class PendingEval:
    """An evaluation under way on the sampler: greedy completions, and `k` samples a prompt when `sampled`."""

    examples: list[Example]
    greedy: PendingRollouts
    sampled: PendingRollouts | None
    k: int
    greedy_graded: GradedBatch | None = None  # once finished: the greedy samples and their grades (rollout record)

    def finish(self, tokenizer, grader: Grader, timeout_s: float) -> dict[str, float]:
        start = time.perf_counter()
        greedy = self.greedy.result(timeout_s)
        grades: Grades = grade(greedy, self.examples, tokenizer, grader).result()
        self.greedy_graded = GradedBatch(self.examples, greedy, grades)
        metrics = {
            "eval/accuracy": statistics.fmean(grades.components[grader.primary]),
            "eval/reward": statistics.fmean(grades.scores),
            **grades.metrics("eval"),
            **episode_metrics(greedy, "eval/episode"),
        }
        if self.sampled is not None:
            rollouts = self.sampled.result(timeout_s)
            scores = grade(rollouts, self.examples, tokenizer, grader).result().components[grader.primary]
            solved = [0] * len(self.examples)
            for rollout, score in zip(rollouts, scores, strict=True):
                solved[rollout.group] += score >= 1.0  # full credit: verl's verifiers score a correct answer 1
            for k in reported_ks(self.k):
                metrics[f"eval/pass@{k}"] = statistics.fmean(pass_at_k(self.k, c, k) for c in solved)
        return {**metrics, "time/eval_wait_s": time.perf_counter() - start}


def start_eval(samplers: SamplerPool, examples: list[Example], cfg: RunConfig, with_samples: bool) -> PendingEval:
    """Queue the held-out prompts on the sampler, with the weights it serves: greedy, and with `with_samples`
    also `trainer.eval_pass_k` samples a prompt at `sampler.temperature` (none when it is 0)."""
    s, k = cfg.sampler, cfg.trainer.eval_pass_k
    prompts = [e.prompt_ids for e in examples]
    tools_kwargs = [e.tools_kwargs for e in examples] if cfg.episode.enable else None
    greedy = samplers.generate(
        prompts,
        SamplingSettings(n=1, temperature=0.0, max_tokens=s.response_length, logprobs=False),
        tools_kwargs=tools_kwargs,
    )
    sampled = None
    if with_samples and k > 0:
        settings = SamplingSettings(k, s.temperature, s.top_p, s.top_k, s.response_length, logprobs=False)
        seeds = [sampling_seed(s.seed, EVAL_BATCH, i) for i in range(len(prompts))]
        sampled = samplers.generate(prompts, settings, seeds, tools_kwargs)
    return PendingEval(examples, greedy, sampled, k)


def pass_at_k_summary(records: list[dict]) -> dict[str, float]:
    """`eval/pass@K_start` and `eval/pass@K_final`: the first and the last evaluation that sampled, for each K both
    have (a resume may change trainer.eval_pass_k: either count of samples estimates the same pass@K)."""
    sampled = [r for r in records if any(key.startswith("eval/pass@") for key in r)]
    if not sampled:
        return {}
    first, last = sampled[0], sampled[-1]
    both = [key for key in first if key.startswith("eval/pass@") and key in last]
    return {f"{key}_{when}": record[key] for when, record in (("start", first), ("final", last)) for key in both}


def describe(summary: dict[str, float]) -> str:
    """The run's result in a line: held-out accuracy (and pass@k) before and after, and the wall time."""
    trained = summary["steps"] > 0

    def change(start: float, final: float) -> str:
        return f"{100 * start:.1f}% -> {100 * final:.1f}%" if trained else f"{100 * start:.1f}%"

    # the baseline is the folder's first evaluation: step 0, or the checkpoint's step of a run resumed into a new folder
    start = f"step {summary['eval/start_step']:.0f}"
    parts = [
        f"held-out accuracy: {change(summary['eval/accuracy_start'], summary['eval/accuracy_final'])}"
        + (f" ({start} -> mean of the last evaluations)" if trained else " (evaluation only)")
    ]
    parts += [
        f"{key.removeprefix('eval/').removesuffix('_start')} {change(value, summary[key[:-6] + '_final'])}"
        for key, value in summary.items()
        if key.startswith("eval/pass@") and key.endswith("_start")
    ]
    return "; ".join(parts + [f"wall time {summary['time/wall_s']:.0f} s"])
