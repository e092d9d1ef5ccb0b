"""Where a trainer rank's memory goes: resident memory and its peak per phase, at trainer world size 1 and 2.

The real-size model of `benchmarks/real_size.py` (Qwen2.5-0.5B's shape and vocabulary), fp32
masters served as bf16, trained on a synthetic batch (no sampler: the trainer alone, so the
figures are the trainer's), with `trainer.return_freed_memory` on (the default) and off. Each
rank is a Ray actor of the real `TrainerWorker`; before each
phase the rank's peak is reset (`/proc/self/clear_refs`), after it the peak (VmHWM) and the
current resident memory, anonymous and shared (the object store's pages a rank wrote), are
read from `/proc/self/status`.

    python benchmarks/trainer_memory.py        # writes benchmarks/results/trainer_memory.json
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu.config import RunConfig
from rl_tpu.controller.actors import trainer_env
from rl_tpu.records import TrainBatch
from rl_tpu.trainer.worker import TrainerWorker

STATUS_KEYS = {"VmHWM": "peak_mb", "VmRSS": "rss_mb", "RssAnon": "anon_mb", "RssShmem": "shmem_mb"}


class ProfiledTrainer(TrainerWorker):
    """The real trainer, plus the calls that read and reset its process's resident memory."""

    def reset_peak(self) -> None:
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM := VmRSS

    def memory(self) -> dict[str, float]:
        fields = dict(line.split(":", 1) for line in Path("/proc/self/status").read_text().splitlines() if ":" in line)
        return {label: int(fields[key].split()[0]) / 1024 for key, label in STATUS_KEYS.items()}


def synthetic_batch(sequences: int, prompt_len: int, completion_len: int, vocab: int) -> TrainBatch:
    rng = random.Random(0)
    prompts = [[rng.randrange(vocab) for _ in range(prompt_len)] for _ in range(sequences)]
    completions = [[rng.randrange(vocab) for _ in range(completion_len)] for _ in range(sequences)]
    advantages = [[rng.choice([-1.0, 1.0])] * completion_len for _ in range(sequences)]
    return TrainBatch(prompts, completions, [[-1.0] * completion_len] * sequences, advantages, temperature=1.0)


def profile(model: Path, world_size: int, return_freed_memory: bool, args) -> dict:
    import ray

    from rl_tpu.cluster import rendezvous

    cfg = RunConfig()
    cfg.device, cfg.model.path, cfg.model.dtype = "cpu", str(model), "bfloat16"
    cfg.trainer.world_size, cfg.trainer.micro_batch_size = world_size, args.micro_batch_size
    cfg.trainer.activation_checkpointing = True
    cfg.sync.bucket_mb = args.bucket_mb
    store = rendezvous.RendezvousStore(world_size, 60)
    cfg.trainer.return_freed_memory = return_freed_memory
    env = {**trainer_env(cfg.trainer, model), **rendezvous.AGENT_STORE_ENV, **dict(kv.split("=", 1) for kv in args.env)}
    actor = ray.remote(ProfiledTrainer).options(num_cpus=1, runtime_env={"env_vars": env})
    ranks = [actor.remote(cfg, str(model), rank, world_size, store.host, store.port) for rank in range(world_size)]
    phases, seconds = {"start-up": ray.get([r.memory.remote() for r in ranks])}, {}
    batch = ray.put(synthetic_batch(args.sequences, args.prompt_len, args.completion_len, 151_936))
    for phase, method, arg in (
        ("train step 1", "train_step", batch),
        ("train step 2", "train_step", batch),
        ("publish", "publish_weights", 1),
    ):
        ray.get([r.reset_peak.remote() for r in ranks])
        start = time.perf_counter()
        ray.get([getattr(r, method).remote(arg) for r in ranks])
        seconds[phase] = time.perf_counter() - start
        phases[phase] = ray.get([r.memory.remote() for r in ranks])
        print(
            f"world size {world_size}, return_freed_memory={return_freed_memory}, {phase} "
            f"({seconds[phase]:.1f} s): "
            + "; ".join(
                f"rank {i} peak {m['peak_mb']:.0f} MiB, now {m['rss_mb']:.0f} (anon {m['anon_mb']:.0f}, shared "
                f"{m['shmem_mb']:.0f})"
                for i, m in enumerate(phases[phase])
            ),
            flush=True,
        )
    ray.get([r.shutdown.remote() for r in ranks])
    for r in ranks:
        ray.kill(r)
    return {
        "world_size": world_size,
        "return_freed_memory": return_freed_memory,
        "phases": phases,
        "seconds": seconds,
        "largest_peak_mb": max(m["peak_mb"] for ms in phases.values() for m in ms),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--sequences", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=256)
    parser.add_argument("--completion-len", type=int, default=128)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument(
        "--settings",
        choices=["both", "default"],
        default="both",
        help="trainer.return_freed_memory true and false (both), or the default (true) only",
    )
    parser.add_argument("--env", nargs="*", default=[], metavar="KEY=VALUE", help="extra environment of the ranks")
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "trainer_memory.json")
    args = parser.parse_args()
    import ray
    import real_size

    os.environ.setdefault("MALLOC_ARENA_MAX", "2")  # as real_size.py runs
    load_before = os.getloadavg()
    ray.init(address="local", num_cpus=4, include_dashboard=False, object_store_memory=2 * 2**30, log_to_driver=False)
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        model = real_size.build_model_in_subprocess(Path(tmp) / "model")
        for freed in (True, False) if args.settings == "both" else (True,):
            for world_size in args.world_sizes:
                runs.append(profile(model, world_size, freed, args))
    ray.shutdown()
    for run in runs:
        base = next(
            r
            for r in runs
            if r["world_size"] == min(args.world_sizes) and r["return_freed_memory"] == run["return_freed_memory"]
        )
        run["largest_peak_vs_smallest_world_size"] = run["largest_peak_mb"] / base["largest_peak_mb"]
        print(
            f"world size {run['world_size']}, return_freed_memory={run['return_freed_memory']}: largest peak "
            f"{run['largest_peak_mb']:.0f} MiB ({run['largest_peak_vs_smallest_world_size']:.2f} x world size "
            f"{base['world_size']}); train step 2 {run['seconds']['train step 2']:.1f} s"
        )
    write_record(args.out, load_before, args={k: str(v) for k, v in vars(args).items()}, runs=runs)


if __name__ == "__main__":
    main()
