"""Episodes that advance on their own against lockstep: a batch of episodes on the real in-process vLLM engine
(the tiny model, random weights) through rl_tpu's episode loop and tool workers, under both schedulers.

Each model turn calls the tool with probability 3/4 (a hash of its sampled ids decides, so an episode's length, 1
to 6 turns, is drawn per episode by the engine's seeded sampling, the same under both schedulers), up to 6 turns.
Two workloads:

- heavy-tailed: a tool that awaits a log-normal latency (median 0.2 s, sigma 1.2: about one call in 40 takes over
  2 s; drawn from the call's arguments, so the same calls take the same time under both schedulers);
- uniform: a CPU-bound tool (each call computes for 50 ms, blocking its worker).

The engine computes with one torch thread, as a run's engine actor does (`sampler.num_cpus=1`; `--engine-threads`).
Both schedulers must make the same episodes (ids, masks, logprobs: `same_episodes`). Per batch: the step time (the batch's wall time), the engine's idle share (1 - seconds in engine steps / step time)
and the tool wait share (seconds an episode waited for its tools, mean over episodes / step time). Runs lockstep and
async alternately (A B A B ...) in one invocation, with the same seeds in each pair; the figure is the median of
the pairs' ratios.

    python benchmarks/episodes.py          # about 2 minutes (4 pairs); writes results/episodes.json
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from record import write_record  # beside this script
from tool_calls import tools_yaml  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu.episodes.asynchronous import AsyncScheduler  # noqa: E402
from rl_tpu.episodes.episode import EpisodeLimits  # noqa: E402
from rl_tpu.episodes.loop import EpisodeRunner, LockstepScheduler  # noqa: E402
from rl_tpu.episodes.render import PlainRenderer  # noqa: E402
from rl_tpu.episodes.tools import ToolBox, ToolSettings  # noqa: E402

TOOLS = """
import asyncio
import time
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Remote(BaseTool):  # awaits: a remote environment, a sandbox, a search
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(parameters["seconds"])
        return ToolResponse(text="ok"), 0.0, {}

class Compute(BaseTool):  # blocks its worker: CPU-bound work
    async def execute(self, instance_id, parameters, **kwargs):
        end = time.process_time() + parameters["seconds"]
        while time.process_time() < end:
            pass
        return ToolResponse(text="ok"), 0.0, {}
"""
WORKLOADS = {"heavy_tailed": "remote", "uniform": "compute"}
CALL_P = 0.75  # a turn calls the tool
MEDIAN_S, SIGMA, CPU_S = 0.2, 1.2, 0.05


def uniforms(ids: list[int]) -> tuple[float, float]:
    """Two numbers in (0, 1) fixed by a turn's sampled ids."""
    digest = hashlib.sha256(json.dumps(ids).encode()).digest()
    return tuple((int.from_bytes(digest[i : i + 8], "big") + 0.5) / 2**64 for i in (0, 8))


class DrawnCalls:
    """A stand-in parser: a turn calls `tool` with probability CALL_P, drawn from its ids, with the call's latency
    in its arguments (log-normal for the remote tool, fixed for the compute one)."""

    stop_token_ids: list[int] = []

    def __init__(self, tool: str):
        self.tool = tool

    def parse(self, ids: list[int]) -> tuple[list[tuple[str, str]], int]:
        calls, latency = uniforms(ids)
        if calls >= CALL_P:
            return [], 0
        if self.tool == "remote":
            seconds = MEDIAN_S * math.exp(SIGMA * statistics.NormalDist().inv_cdf(latency))
        else:
            seconds = CPU_S
        return [(self.tool, json.dumps({"seconds": seconds}))], 0

    def answer_length(self, ids: list[int]) -> int:
        return len(ids)


def engine_for(model: Path, max_len: int, threads: int):
    import torch

    from rl_tpu.sampler.engine import EngineOptions, SamplingSettings, sampled_tokens, sampling_params, start_vllm
    from rl_tpu.sampler.episode_requests import EngineRequests

    os.environ.update({"VLLM_ENABLE_V1_MULTIPROCESSING": "0", "VLLM_LOGGING_LEVEL": "WARNING"})
    torch.set_num_threads(threads)  # as a run's engine actor does before vLLM starts (`CpuBinding.apply`)
    llm = start_vllm(str(model), "float32", max_len, 0.25, 0, EngineOptions(), [])
    settings = SamplingSettings(n=1, temperature=1.0)
    return lambda: EngineRequests(
        llm,
        lambda r: sampling_params(settings, 1, r.max_tokens, r.seed),
        lambda completion: sampled_tokens(completion, settings),
        None,
        0,
    )


def one_batch(runner: EpisodeRunner, engine, prompts: list[list[int]], samples: int, seed: int) -> dict:
    start = time.perf_counter()
    rollouts = runner.run(prompts, samples, [seed + i for i in range(len(prompts))], [{}] * len(prompts), engine)
    step_s = time.perf_counter() - start
    turns = [r.episode.turns for r in rollouts]
    return {
        "step_s": step_s,
        "engine_idle_share": 1 - engine.busy_s / step_s,
        "tool_wait_share": statistics.mean(r.episode.tool_s for r in rollouts) / step_s,
        # no scheduler ends the batch before its slowest episode's own tool calls: the floor the step time is held to
        "slowest_episode_tool_s": max(r.episode.tool_s for r in rollouts),
        "turns_mean": statistics.mean(turns),
        "turns_max": max(turns),
        "calls": sum(sum(r.episode.tool_calls.values()) for r in rollouts),
        # the episodes' tokens and masks: both schedulers must make the same
        "episodes_sha256": hashlib.sha256(
            json.dumps([(r.completion_ids, r.model_mask) for r in rollouts]).encode()
        ).hexdigest(),
        "logprobs": [lp for r in rollouts for lp in r.logprobs],
    }


def compare(rows: list[dict], workload: str) -> dict:
    """Per pair, async's step time over lockstep's (their median is the figure), the shares, and whether the
    pair made the same episodes: tokens and masks equal, logprobs within `max_logprob_gap` (vLLM's CPU kernels round
    a sequence's logits differently in different batch shapes)."""
    pairs = {}
    for row in rows:
        if row["workload"] == workload:
            pairs.setdefault(row["pair"], {})[row["scheduling"]] = row
    ratios = [p["async"]["step_s"] / p["lockstep"]["step_s"] for p in pairs.values()]
    median = lambda key, name: statistics.median(p[name][key] for p in pairs.values())  # noqa: E731
    return {
        "ratio_async_to_lockstep_per_pair": ratios,
        "ratio_async_to_lockstep_median": statistics.median(ratios),
        **{f"{name}_{key}_median": median(key, name) for name in ("lockstep", "async") for key in SHARES},
        "same_tokens_and_masks": all(
            p["async"]["episodes_sha256"] == p["lockstep"]["episodes_sha256"] for p in pairs.values()
        ),
        "max_logprob_gap": max(
            (
                max(abs(a - b) for a, b in zip(p["async"]["logprobs"], p["lockstep"]["logprobs"]))
                for p in pairs.values()
                if p["async"]["episodes_sha256"] == p["lockstep"]["episodes_sha256"]
            ),
            default=None,
        ),
    }


SHARES = ("step_s", "engine_idle_share", "tool_wait_share", "slowest_episode_tool_s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--samples", type=int, default=4, help="episodes per prompt")
    parser.add_argument("--pairs", type=int, default=4, help="lockstep/async pairs per workload (A B A B)")
    parser.add_argument("--turn-tokens", type=int, default=8, help="tokens a model turn may sample")
    parser.add_argument(
        "--engine-threads", type=int, default=1, help="the engine's torch threads (a run's: sampler.threads)"
    )
    parser.add_argument("--workloads", nargs="+", choices=list(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "episodes.json")
    args = parser.parse_args()
    from transformers import AutoTokenizer

    from rl_tpu.config import DataConfig, TinyModelConfig
    from rl_tpu.models.resolve import build_tiny_arith

    load_before = os.getloadavg()
    limits = EpisodeLimits(max_turns=6, max_tokens=400, turn_tokens=args.turn_tokens, max_model_len=512)
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        model = Path(folder) / "tiny"
        build_tiny_arith(TinyModelConfig(warm_start_steps=0, max_position_embeddings=512), DataConfig(), model)
        tokenizer = AutoTokenizer.from_pretrained(model)
        prompts = [tokenizer(f"Q: What is {a} * {a + 7}? A:")["input_ids"] for a in range(3, 3 + args.prompts)]
        new_engine = engine_for(model, 512, args.engine_threads)
        box = ToolBox(
            ToolSettings(tools_yaml(Path(folder), TOOLS, "bench_tools", ("Remote", "Compute")), None, 2, 60.0, 2048, 64)
        )
        renderer = PlainRenderer(tokenizer, "\n<tool_response>\n{result}\n</tool_response>\n")
        try:
            warm = EpisodeRunner(limits, DrawnCalls("compute"), box, renderer, scheduler=LockstepScheduler())
            one_batch(
                warm, new_engine(), prompts, args.samples, seed=7
            )  # untimed: the engine's and workers' first calls
            for workload in args.workloads:
                for pair in range(args.pairs):
                    for name, scheduler in (("lockstep", LockstepScheduler()), ("async", AsyncScheduler(64))):
                        runner = EpisodeRunner(
                            limits, DrawnCalls(WORKLOADS[workload]), box, renderer, scheduler=scheduler
                        )
                        row = one_batch(runner, new_engine(), prompts, args.samples, seed=1000 * pair)
                        rows.append({"workload": workload, "scheduling": name, "pair": pair, **row})
                        print(json.dumps({k: v for k, v in rows[-1].items() if k != "logprobs"}), flush=True)
        finally:
            box.close()
    summary = {workload: compare(rows, workload) for workload in args.workloads}
    for row in rows:
        del row["logprobs"]
    print(json.dumps(summary, indent=1))
    write_record(
        args.out,
        load_before,
        episodes=args.prompts * args.samples,
        max_turns=limits.max_turns,
        turn_tokens=args.turn_tokens,
        tool_workers=2,
        engine_threads=args.engine_threads,
        latency={"heavy_tailed": f"log-normal, median {MEDIAN_S} s, sigma {SIGMA}", "uniform": f"{CPU_S} s of CPU"},
        targets={"heavy_tailed": "ratio <= 0.6", "uniform": "ratio <= 1.0"},
        summary=summary,
        runs=rows,
    )


if __name__ == "__main__":
    main()
