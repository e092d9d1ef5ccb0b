"""The consistency certificate: does the engine serve the distribution the trainer trains?

    python -m rl_tpu.consistency model.dtype=bfloat16 --out benchmarks/results
    python -m rl_tpu.consistency model.path=/models/qwen model.dtype=float32 sampler.tensor_parallel_size=2

On fixed token sequences (fixed texts in the model's own tokenizer), the vLLM engine (`rl_tpu.sampler`, set
up as a run sets it up: dtype, fp32 residual, eager or compiled, tensor parallelism) and trainer rank 0
(`rl_tpu.trainer.TrainerWorker`: the same model loading, FSDP2 wrapping and mixed precision) each give the
full next-token log-softmax at every position; `rl_tpu.models.agreement` compares them (KL both ways, total
variation, the largest logprob difference, the share of positions whose argmax differs) and checks the
bounds of the dtype. The settings are a run's keys (`model.*`, `device`, `trainer.world_size`,
`sampler.tensor_parallel_size`, ...). Each setting's certificate is added to OUT/NAME.json (one entry per
dtype, world size, tensor-parallel size and backend) and NAME.md; the exit status is 1, naming each measure,
its value and its bound, when one is past its bound.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

# Fixed inputs: repeated and cut to --length tokens in the model's tokenizer, one sequence per text.
TEXTS = (
    "Q: What is 47 * 83? A: 3901. Q: What is 12 + 30? A: 42. Q: What is 99 - 58? A: 41.",
    "The engine and the trainer read the same weights, so they should agree on every next token.",
    "def add(a, b):\n    return a + b\n\nprint(add(2, 3))  # 5\n",
    "Sampling at temperature one draws each token in proportion to its probability under the policy.",
)


def parse(argv: list[str] | None):
    parser = argparse.ArgumentParser(prog="python -m rl_tpu.consistency", description=__doc__.splitlines()[0])
    parser.add_argument("settings", nargs="*", metavar="KEY=VALUE", help="run settings, e.g. model.dtype=bfloat16")
    parser.add_argument("--sequences", type=int, default=4, help=f"fixed sequences (at most {len(TEXTS)})")
    parser.add_argument("--length", type=int, default=16, help="tokens a sequence: length - 1 positions each")
    parser.add_argument("--out", type=Path, default=Path("consistency"), help="the folder for NAME.json and NAME.md")
    parser.add_argument("--name", help="the files' name; default consistency_<device>_<model folder>")
    args = parser.parse_args(argv)
    if not 1 <= args.sequences <= len(TEXTS) or args.length < 2:
        parser.error(f"--sequences must be 1 to {len(TEXTS)} and --length at least 2")
    return args


def run_config(settings: list[str]):
    """The run's config with `settings` applied and checked as a run checks them; the certificate's own limits
    refused by key."""
    from omegaconf import OmegaConf

    from rl_tpu.config import RunConfig

    cfg = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.from_dotlist(settings)))
    if cfg.trainer.world_size != 1:
        raise SystemExit(
            f"trainer.world_size={cfg.trainer.world_size}: the certificate runs trainer rank 0 alone, in this "
            "process (world size 1); FSDP2 sharding over several ranks is not certified yet"
        )
    cfg.actor.use_kl_loss = cfg.algorithm.use_kl_in_reward = False  # no reference model: only the policy is compared
    return cfg


def fixed_sequences(model_path: Path, count: int, length: int) -> list[list[int]]:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    sequences = []
    for text in TEXTS[:count]:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        sequences.append((ids * (length // len(ids) + 1))[:length])
    return sequences


def engine_logprobs(cfg, model_path: Path, sequences: list[list[int]]):
    """The engine's rows: one vLLM engine (a Ray actor) set up as a run sets up its engines, shut down after."""
    import ray

    from rl_tpu.sampler.engine import EngineOptions, launch_sampler

    tp = cfg.sampler.tensor_parallel_size
    options = EngineOptions(
        enforce_eager=cfg.engine_eager,
        fp32_residual=cfg.model.fp32_residual,
        tensor_parallel_size=tp,
        full_distributions=True,
    )
    resources = {"num_cpus": 1} if str(cfg.device) == "cpu" else {"num_cpus": 1, "num_gpus": tp}
    dtype, max_len = str(cfg.model.dtype), max(map(len, sequences)) + 1
    ray.init(address="local", include_dashboard=False, log_to_driver=False, object_store_memory=256 * 2**20)
    try:
        engine = launch_sampler(
            str(model_path), dtype, max_len, cfg.sampler.kv_cache_gb, cfg.sampler.seed, options, resources
        )
        try:
            return ray.get(engine.next_token_logprobs.remote(sequences), timeout=cfg.ray.start_timeout_s)
        finally:
            ray.get(engine.shutdown.remote(), timeout=120)
    finally:
        ray.shutdown()


def trainer_logprobs(cfg, model_path: Path, sequences: list[list[int]]):
    """Trainer rank 0's rows: a `TrainerWorker` of world size 1 in this process, its rendezvous held here."""
    import torch

    from rl_tpu.cluster.rendezvous import AGENT_STORE_ENV, RendezvousStore
    from rl_tpu.trainer.worker import TrainerWorker

    threads, store = torch.get_num_threads(), RendezvousStore(1, cfg.ray.start_timeout_s)
    os.environ.update(AGENT_STORE_ENV)
    worker = TrainerWorker(cfg, str(model_path), 0, 1, store.host, store.port)
    try:
        return worker.next_token_logprobs(sequences)
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
        for key in AGENT_STORE_ENV:
            os.environ.pop(key)


def setting_label(cfg, backend: str) -> str:
    """One certificate's key: what decides the numbers besides the model."""

    residual = ", fp32 residual" if cfg.model.fp32_residual and str(cfg.model.dtype) != "float32" else ""
    return (
        f"{cfg.model.dtype}{residual}, world size {cfg.trainer.world_size}, "
        f"tensor parallel {cfg.sampler.tensor_parallel_size}, {backend}"
    )


def certify(cfg, args) -> dict:
    """One setting's certificate: the figures, the bounds of its dtype and what exceeded them."""
    import torch
    import vllm

    from rl_tpu.cluster.device import Device
    from rl_tpu.config import cache_path
    from rl_tpu.models.agreement import BOUNDS, agreement, exceeded
    from rl_tpu.models.resolve import resolve_model_path

    cfg.device = Device.resolve(cfg.device).kind  # as the actors' config has it (eager engines on CPU)
    model_path = resolve_model_path(cfg.model, cfg.data, cache_path(cfg))
    sequences = fixed_sequences(model_path, args.sequences, args.length)
    started = time.perf_counter()
    engine = engine_logprobs(cfg, model_path, sequences)
    trainer = trainer_logprobs(cfg, model_path, sequences)
    figures = agreement(engine, trainer)
    dtype = str(cfg.model.dtype)
    backend = f"vllm {vllm.__version__} on {cfg.device}, torch {torch.__version__}"
    return {
        "setting": setting_label(cfg, backend),
        "model": str(model_path),
        "dtype": dtype,
        "fp32_residual": cfg.model.fp32_residual,
        "world_size": cfg.trainer.world_size,
        "tensor_parallel_size": cfg.sampler.tensor_parallel_size,
        "backend": backend,
        "inputs": f"{len(sequences)} fixed sequences of {args.length} tokens: {figures['positions']} positions x "
        f"{engine.shape[1]} tokens",
        "figures": figures,
        "bounds": BOUNDS[dtype],
        "exceeded": exceeded(figures, dtype),
        "wall_s": time.perf_counter() - started,
    }


def markdown(record: dict) -> str:
    """A short report: one row per certified setting."""
    measures = ["kl_engine_trainer", "kl_trainer_engine", "tv_mean", "tv_max", "max_abs_logprob_diff"]
    lines = [
        f"# Consistency certificate: {record['model']}",
        "",
        f"{record['date']}, {record['machine']}. Engine (vLLM) against trainer rank 0, full next-token "
        "distributions on fixed inputs; bounds from `rl_tpu/models/agreement.py`.",
        "",
        "| setting | positions | " + " | ".join(measures) + " | argmax differs | within bounds |",
        "|---|---|" + "---|" * len(measures) + "---|---|",
    ]
    for c in record["certificates"].values():
        f = c["figures"]
        cells = [f"{f[m]:.3g} (<= {c['bounds'][m]:g})" if m in c["bounds"] else f"{f[m]:.3g}" for m in measures]
        verdict = "yes" if not c["exceeded"] else "NO: " + "; ".join(c["exceeded"])
        lines.append(
            f"| {c['setting']} | {f['positions']} | "
            + " | ".join(cells)
            + f" | {f['argmax_differs']:.3g} | {verdict} |"
        )
    return "\n".join(lines) + "\n"


def record_certificate(out: Path, name: str, certificate: dict) -> dict:
    """Add the certificate to OUT/NAME.json (replacing one of the same setting) and rewrite NAME.md from it."""
    path = out / f"{name}.json"
    record = json.loads(path.read_text()) if path.is_file() else {"certificates": {}}
    record.update(
        date=time.strftime("%Y-%m-%d %H:%M"),
        machine=f"{platform.machine()}, {os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f}",
        model=Path(certificate["model"]).name,
    )
    record["certificates"][certificate["setting"]] = certificate
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=2) + "\n")
    (out / f"{name}.md").write_text(markdown(record))
    return record


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    cfg = run_config(args.settings)
    certificate = certify(cfg, args)
    name = args.name or f"consistency_{cfg.device}_{Path(certificate['model']).name}"
    record_certificate(args.out, name, certificate)
    print(f"{certificate['setting']}: {json.dumps(certificate['figures'])}; wrote {args.out / name}.json and .md")
    for failure in certificate["exceeded"]:
        print(f"consistency: {certificate['setting']}: {failure} (model.dtype={certificate['dtype']})", file=sys.stderr)
    return 1 if certificate["exceeded"] else 0


if __name__ == "__main__":
    sys.exit(main())
