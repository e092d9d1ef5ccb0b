"""The device check: a few GRPO steps on the device this host has, with the figures that tell it works well.

One script, meant to finish in under 5 minutes on a GPU. Its checks (`--checks`, all by default):

- `tiny`: the tiny recipe (`model=tiny_arith`, fp32) for `--steps` steps on `--device`: the whole
  loop (placement, FSDP2 ranks, vLLM engine, weight sync) on real hardware;
- `real_size`: the real-size benchmark (`benchmarks/real_size.py`: Qwen2.5-0.5B's shape and
  vocabulary, bf16, GSM8K) at trainer world size 1;
- `trainer`: the trainer alone, which needs no vLLM: one FSDP2 rank (`TrainerWorker`, world
  size 1) of a Qwen2.5-shaped model (`--trainer-shape`, bf16 mixed precision) trains on a
  synthetic GRPO batch (`--prompts` x `--n` sequences, completions of 1 to `--completion-len`
  tokens), then publishes its weights through each of `--transports` (shm_file, object_store:
  a local Ray), fetches them back with every checksum verified, and compares them with the
  trainer's. Its old-policy logprobs are a plain fp32 Hugging Face forward's, so the first
  step's `logprob_diff` is the trainer's gap to that reference;
- `ipc`: the `cuda_ipc` handoff of a bundle as large as the trainer shape's weights;
- `consistency`: the consistency certificate (`python -m rl_tpu.consistency`) of the tiny model in fp32
  and bf16 and of the trainer shape's model in bf16, recorded beside the other results; it needs vLLM
  and Ray, and is skipped (saying so) where they are not installed.

Each reports trainer MFU (6 x parameters x positions computed per second of the train step,
against the bf16 dense peak of the GPU it finds; on CPU the achieved FLOP/s only), and
weight-sync GB/s next to a copy of the same number of bytes measured in the same run (device
to device; for `trainer`, device to host, the path its weights take); `tiny` and `real_size`
also generated tokens/s.

    python benchmarks/device_check.py --device cuda     # writes benchmarks/results/device_check_cuda.json
    python benchmarks/device_check.py --device cuda --checks trainer --trainer-shape 3b
    python benchmarks/device_check.py --device cpu --checks tiny trainer --trainer-shape tiny --steps 2  # tests
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu.cluster.memory import peak_rss_mb
from rl_tpu.config import RunConfig
from rl_tpu.outputs.metrics import read_metrics
from rl_tpu.records import TrainBatch

# Dense bf16 tensor-core peaks (TFLOP/s, without sparsity) from the vendors' data sheets, by a name
# fragment of torch.cuda.get_device_name(); the first fragment that matches wins.
BF16_PEAK_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "GH200": 989.0,
    "B200": 2250.0,
    "A100": 312.0,
    "L40S": 362.0,
    "L4": 121.0,
    "A10G": 70.0,
    "A10": 125.0,
    "RTX 4090": 165.0,
}


def bf16_peak_tflops(device: str) -> tuple[str, float | None]:
    """The accelerator's name and its bf16 dense peak (None when unknown, or on CPU)."""
    if device != "cuda":
        return "cpu", None
    import torch

    name = torch.cuda.get_device_name(0)
    return name, next((peak for fragment, peak in BF16_PEAK_TFLOPS.items() if fragment in name), None)


def copy_gb_per_s(num_bytes: int, device: str, to_host: bool = False, repeats: int = 5) -> float:
    """A copy of `num_bytes` on `device` (to the host's pageable memory with `to_host`): the ceiling a weight
    sync is compared with."""
    import torch

    from rl_tpu.cluster.device import Device

    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty(num_bytes, dtype=torch.uint8, device="cpu" if to_host else device)
    times = []
    for _ in range(repeats + 1):  # the first warms caches and allocators
        Device(device).synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        Device(device).synchronize()
        times.append(time.perf_counter() - start)
    return num_bytes / statistics.median(times[1:]) / 1e9


def parameter_count(model_path: Path) -> int:
    """Parameters of the model folder, counted on the meta device (nothing allocated)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return sum(p.numel() for p in model.parameters())


def figures(run_dir: Path, model_path: Path, device: str, peak_tflops: float | None) -> dict:
    """Medians over the measured steps (after the first) of one run's metrics."""
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if "actor/loss" in r]
    measured = rows[1:] or rows

    def median(key: str) -> float:
        return statistics.median(r[key] for r in measured)

    params = parameter_count(model_path)
    train_flops = 6 * params * median("perf/train_positions") / median("time/train_s")  # forward 2, backward 4
    sync_bytes = median("sync/bytes")
    sync_gb_per_s = sync_bytes / median("time/sync_s") / 1e9
    copy = copy_gb_per_s(int(sync_bytes), device)
    return {
        "parameters": params,
        "steps_measured": len(measured),
        "train_tflops_per_s": train_flops / 1e12,
        "mfu": train_flops / 1e12 / peak_tflops if peak_tflops else None,
        "gen_tokens_per_s": median("perf/gen_tokens_per_s"),
        "train_tokens_per_s": median("perf/train_tokens_per_s"),
        "step_s": median("time/step_s"),
        "logprob_diff": median("actor/logprob_diff"),
        "sync_bytes": sync_bytes,
        "sync_gb_per_s": sync_gb_per_s,
        "device_copy_gb_per_s": copy,
        "sync_vs_copy": sync_gb_per_s / copy,
    }


def tiny_config(device: str, steps: int, warm_start_steps: int, cache_dir: Path) -> RunConfig:
    cfg = RunConfig()
    cfg.device, cfg.cache_dir = device, str(cache_dir)
    cfg.model.tiny.warm_start_steps = warm_start_steps
    cfg.data.train_batch_size, cfg.data.num_eval, cfg.sampler.n = 8, 64, 8
    cfg.trainer.total_steps, cfg.trainer.eval_every = steps, 10_000
    cfg.trainer.export, cfg.trainer.checkpoint_final, cfg.trainer.checkpoint_every = False, False, 0
    return cfg


def check_tiny(args, tmp: Path, peak: float | None) -> dict:
    from rl_tpu.controller.run import run as run_training  # Ray and vLLM: the tiny and real_size checks only

    cfg = tiny_config(args.device, args.steps, args.warm_start_steps, tmp / "cache")
    started = time.perf_counter()
    run_training(cfg, tmp / "tiny", show_progress=False)
    (model_path,) = (tmp / "cache" / "models").glob("tiny_arith-*")
    return {
        "workload": "tiny_arith, fp32, 8 prompts x 8 completions x 16 tokens",
        "wall_s": time.perf_counter() - started,
        **figures(tmp / "tiny", model_path, args.device, peak),
    }


def check_real_size(args, tmp: Path, peak: float | None) -> dict:
    import real_size

    model = real_size.build_model_in_subprocess(tmp / "model")
    train, test = real_size.prepare_data(args.gsm8k, tmp / "data")
    options = argparse.Namespace(
        device=args.device, prompts=8, n=4, new_tokens=128, micro_batch_size=2, warmup=1, steps=2
    )
    cfg = real_size.run_config(model, train, test, 1, options)
    if args.device != "cpu":
        cfg.sampler.kv_cache_gb = None  # gpu_memory_utilization decides
    from rl_tpu.controller.run import run as run_training

    started = time.perf_counter()
    run_training(cfg, tmp / "real", show_progress=False)
    return {
        "workload": "Qwen2.5-0.5B shape, bf16, GSM8K, 8 prompts x 4 completions x 128 tokens, world size 1",
        "wall_s": time.perf_counter() - started,
        **figures(tmp / "real", model, args.device, peak),
    }


def grpo_batch(prompts: int, n: int, prompt_len: int, completion_len: int, vocab: int) -> TrainBatch:
    """`prompts` groups of `n` sequences: one prompt each, completions of 1 to `completion_len` random tokens,
    group-normalised 0/1 rewards as advantages (a seeded synthetic batch: the step's cost, not its learning)."""
    rng = random.Random(0)
    prompt_ids, completions, advantages = [], [], []
    for _ in range(prompts):
        prompt = [rng.randrange(vocab) for _ in range(prompt_len)]
        rewards = [float(rng.random() < 0.5) for _ in range(n)]
        mean = sum(rewards) / n
        std = statistics.pstdev(rewards) or 1.0
        for reward in rewards:
            length = rng.randint(1, completion_len)
            prompt_ids.append(prompt)
            completions.append([rng.randrange(vocab) for _ in range(length)])
            advantages.append([(reward - mean) / std] * length)
    return TrainBatch(prompt_ids, completions, [[0.0] * len(c) for c in completions], advantages, temperature=1.0)


def reference_logprobs(model_path: Path, batch: TrainBatch, device: str) -> list[list[float]]:
    """Each completion token's logprob under a plain fp32 Hugging Face forward of the model folder, one group
    (shared prompt, completions padded on the right, which later positions cannot change) at a time."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).to(device).eval()
    out = [None] * len(batch)
    groups: dict[tuple[int, ...], list[int]] = {}
    for i, prompt in enumerate(batch.prompt_ids):
        groups.setdefault(tuple(prompt), []).append(i)
    with torch.no_grad():
        for prompt, rows in groups.items():
            width = len(prompt) + max(len(batch.completion_ids[i]) for i in rows)
            ids = torch.zeros(len(rows), width, dtype=torch.long)
            for r, i in enumerate(rows):
                seq = [*prompt, *batch.completion_ids[i]]
                ids[r, : len(seq)] = torch.tensor(seq)
            logits = model(ids.to(device)).logits.float() / batch.temperature
            logprobs = (
                logits[:, len(prompt) - 1 : -1].log_softmax(-1).gather(-1, ids[:, len(prompt) :, None].to(device))
            )
            for r, i in enumerate(rows):
                out[i] = logprobs[r, : len(batch.completion_ids[i]), 0].tolist()
    del model
    if device == "cuda":
        torch.cuda.empty_cache()
    return out


def trainer_model(shape: str, folder: Path) -> Path:
    if shape == "tiny":
        from rl_tpu.config import DataConfig, TinyModelConfig
        from rl_tpu.models.resolve import build_tiny_arith

        build_tiny_arith(TinyModelConfig(warm_start_steps=0), DataConfig(), folder)
        return folder
    from real_size import build_model_in_subprocess

    return build_model_in_subprocess(folder, shape)


def check_trainer(args, tmp: Path, peak: float | None) -> dict:
    import torch
    from logprob_gap import free_port  # a port for the one rank's own group (no Ray here)
    from omegaconf import OmegaConf

    from rl_tpu.trainer.worker import TrainerWorker

    model_path = trainer_model(args.trainer_shape, tmp / f"trainer-{args.trainer_shape}")
    vocab = json.loads((model_path / "config.json").read_text())["vocab_size"]
    batch = grpo_batch(args.prompts, args.n, args.prompt_len, args.completion_len, vocab)
    batch = dataclasses.replace(batch, sampler_logprobs=reference_logprobs(model_path, batch, args.device))
    cfg = RunConfig()
    cfg.device, cfg.model.dtype = args.device, "float32" if args.trainer_shape == "tiny" else "bfloat16"
    cfg.trainer.micro_batch_size, cfg.trainer.compile = args.micro_batch_size, args.compile
    cfg.trainer.skip_zero_advantage_rows = False  # the whole batch's cost, groups scored alike included
    cfg = with_settings(cfg, args.set)
    if args.device == "cuda":
        torch.cuda.reset_peak_memory_stats()
    worker = TrainerWorker(cfg, str(model_path), 0, 1, "127.0.0.1", free_port())
    try:
        steps = [worker.train_step(batch) for _ in range(args.steps)]
        profile = profiled_step(worker, batch, args.device) if args.profile else None
        start = time.perf_counter()
        for _ in worker.served_buckets():  # gathered, cast and on the host: what publishing starts from
            pass
        gather_s = time.perf_counter() - start
        trained = worker.full_state_dict()
        publish = {name: publish_and_fetch(worker, trained, name, cfg.sync.shm_dir) for name in args.transports}
    finally:
        worker.shutdown()
    measured = steps[1:] or steps
    train_s = statistics.median(r["time/train_s"] for r in measured)
    positions = statistics.median(r["perf/train_positions"] for r in measured)
    params = parameter_count(model_path)
    train_flops = 6 * params * positions / train_s
    first = publish[args.transports[0]]
    copy = copy_gb_per_s(first["bytes"], args.device, to_host=True)
    # what torch allocated on the GPU; on the CPU this process's peak resident memory (the reference model's too)
    memory = torch.cuda.max_memory_allocated() / 2**30 if args.device == "cuda" else peak_rss_mb() / 2**10
    return {
        "workload": f"{args.trainer_shape} shape, {cfg.model.dtype}, "
        f"{args.prompts} prompts x {args.n} sequences, "
        f"prompts of {args.prompt_len} and completions of 1-{args.completion_len} tokens, "
        f"micro-batches of {args.micro_batch_size}, compile={args.compile}, world size 1"
        + "".join(f", {setting}" for setting in args.set),
        "trainer_settings": OmegaConf.to_container(OmegaConf.structured(cfg.trainer), enum_to_str=True),
        "parameters": params,
        "steps_measured": len(measured),
        "step_s": train_s,
        "train_s_each_step": [r["time/train_s"] for r in steps],
        "train_tflops_per_s": train_flops / 1e12,
        "mfu": train_flops / 1e12 / peak if peak else None,
        "train_positions": positions,
        "padding_frac": measured[0]["perf/padding_frac"],
        "train_tokens_per_s": positions / train_s,
        "peak_memory_gib": memory,
        "logprob_diff_first_step": steps[0]["actor/logprob_diff"],
        "loss": [r["actor/loss"] for r in steps],
        "grad_norm": [r["actor/grad_norm"] for r in steps],
        "sync_bytes": first["bytes"],
        "gather_to_host_s": gather_s,
        "sync_gb_per_s": first["gb_per_s"],
        "device_to_host_copy_gb_per_s": copy,
        "sync_vs_copy": first["gb_per_s"] / copy,
        "publish": publish,
        "profile": profile,
    }


def publish_and_fetch(worker, trained: dict, transport_name: str, shm_dir: str) -> dict:
    """The worker's weights published through one transport and fetched back (every bucket's checksum is
    verified before anything is returned), each tensor compared with the trainer's."""
    import ray
    import torch

    from rl_tpu.sync.endpoints import pack_buckets, unpack
    from rl_tpu.sync.registry import make_transport

    if transport_name == "object_store":
        ray.init(
            address="local",
            num_cpus=1,
            include_dashboard=False,
            log_to_driver=False,
            object_store_memory=2 * sum(t.nbytes for t in trained.values()) + 2**28,
        )
    transport = make_transport(transport_name, shm_dir)
    try:
        start = time.perf_counter()
        bundle = pack_buckets(worker.served_buckets(), version=1, transport=transport)
        publish_s = time.perf_counter() - start
        start = time.perf_counter()
        fetched, _ = unpack(bundle)
        fetch_s = time.perf_counter() - start
        mismatched = [name for name, tensor in fetched if not torch.equal(tensor, trained[name].to(tensor.dtype))]
        num_bytes = sum(tensor.nbytes for _, tensor in fetched)
    finally:
        transport.close()
        if ray.is_initialized():
            ray.shutdown()
    return {
        "bytes": num_bytes,
        "publish_s": publish_s,
        "gb_per_s": num_bytes / publish_s / 1e9,
        "fetch_verify_s": fetch_s,
        "tensors": len(fetched),
        "mismatched": mismatched,
    }


# bf16 weight bytes of the trainer shapes' models, a tied head once (Qwen2.5-0.5B and -3B: 494M and 3.09B parameters)
IPC_BYTES = {"tiny": 8 * 2**20, "0.5b": 494_032_768 * 2, "3b": 3_085_938_688 * 2}


def check_ipc(args, tmp: Path, peak: float | None) -> dict:
    """The `cuda_ipc` handoff of a bundle as large as the trainer shape's bf16 weights: this process puts each bucket
    (random bytes on the device) through `CudaIpcTransport`, device checksum included; a second process on the same
    device opens each handle, checks the checksum there and copies the bucket into buffers of its own, as an
    engine's loader copies into its parameters. Against a device-to-device copy of as many bytes in this run; the
    sender's device memory at each phase. Needs torch alone (no vLLM, no Ray)."""
    import torch
    import torch.multiprocessing as mp

    from rl_tpu.sync.bundle import device_checksum
    from rl_tpu.sync.cuda_ipc import CudaIpcTransport

    total, bucket = IPC_BYTES[args.trainer_shape], int(args.bucket_mb * 2**20)
    sizes = [min(bucket, total - start) for start in range(0, total, bucket)]
    memory = {"start": device_memory_gib(args.device)}
    buffers = [torch.randint(0, 256, (size,), dtype=torch.uint8, device=args.device) for size in sizes]
    memory["buckets_gathered"] = device_memory_gib(args.device)
    transport = CudaIpcTransport()
    start = time.perf_counter()
    handles = [(transport.put_flat(1, i, flat), device_checksum(flat)) for i, flat in enumerate(buffers)]
    put_s = time.perf_counter() - start
    context = mp.get_context("spawn")
    inbox, results = context.Queue(), context.Queue()
    receiver = context.Process(target=receive_buckets, args=(inbox, results, sizes, args.device))
    receiver.start()
    try:
        inbox.put(handles)
        received = results.get(timeout=300)
    finally:
        receiver.join(timeout=60)
    memory["handed_over"] = device_memory_gib(args.device)
    transport.close()
    del buffers, handles
    if args.device == "cuda":
        torch.cuda.empty_cache()
    memory["released"] = device_memory_gib(args.device)
    copy = copy_gb_per_s(total, args.device)
    handoff_s = put_s + received["open_verify_copy_s"]
    return {
        "workload": f"{total / 1e9:.3f} GB in {len(sizes)} buckets of up to {args.bucket_mb:g} MiB "
        f"({args.trainer_shape} shape, bf16), one receiving process on the same device",
        "bytes": total,
        "put_s": put_s,  # the sender's checksums and handles
        **received,
        "handoff_s": handoff_s,
        "handoff_gb_per_s": total / handoff_s / 1e9,
        "device_copy_gb_per_s": copy,
        "handoff_vs_copy": total / handoff_s / 1e9 / copy,
        "sender_memory_gib": memory,
    }


def receive_buckets(inbox, results, sizes: list[int], device: str) -> None:
    """The receiving process of `check_ipc`: its own buffers first, then each bucket opened, checked and copied."""
    import torch

    from rl_tpu.cluster.device import Device
    from rl_tpu.sync.bundle import device_checksum
    from rl_tpu.sync.cuda_ipc import open_shared

    own = [torch.empty(size, dtype=torch.uint8, device=device) for size in sizes]
    handles = inbox.get(timeout=300)
    Device(device).synchronize()
    start = time.perf_counter()
    verified = 0
    for (handle, checksum), target in zip(handles, own):
        flat = open_shared(handle)
        verified += device_checksum(flat) == checksum
        target.copy_(flat)
    Device(device).synchronize()
    results.put({"open_verify_copy_s": time.perf_counter() - start, "buckets_verified": verified})


def device_memory_gib(device: str) -> float:
    """What torch allocated on the GPU (on CPU: this process's resident memory), in GiB."""
    import torch

    if device == "cuda":
        return torch.cuda.memory_allocated() / 2**30
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**30


def with_settings(cfg: RunConfig, settings: list[str]) -> RunConfig:
    """`cfg` with `key=value` settings as the command line takes them (trainer.logprob_chunk_size=512)."""
    from omegaconf import OmegaConf

    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(cfg), OmegaConf.from_dotlist(settings)))


def profiled_step(worker, batch: TrainBatch, device: str) -> dict:
    """One more train step under torch.profiler: its wall time, the seconds the device (on CPU: the host's
    operators) was busy, and the operators that took most of that, by self time."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=activities) as prof:
        wall = worker.train_step(batch)["time/train_s"]
    events = prof.key_averages()
    busy = (lambda e: e.self_device_time_total) if device == "cuda" else (lambda e: e.self_cpu_time_total)
    top = sorted(events, key=busy, reverse=True)[:25]
    return {
        "train_s": wall,
        "busy_s": sum(map(busy, events)) / 1e6,
        "top_ops": [{"op": e.key, "self_s": busy(e) / 1e6, "calls": e.count} for e in top],
    }


def report(label: str, check: dict, peak: float | None) -> None:
    if label == "consistency":
        print(f"consistency: {check.get('skipped') or check['exit_status']}")
        return
    if label == "ipc":
        print(
            f"ipc: {check['bytes'] / 1e9:.2f} GB handed over in {check['handoff_s']:.3f} s "
            f"({check['handoff_gb_per_s']:.1f} GB/s vs a device copy {check['device_copy_gb_per_s']:.1f} GB/s), "
            f"{check['buckets_verified']} buckets verified"
        )
        return
    mfu = f"MFU {100 * check['mfu']:.1f}% of {peak:g} TFLOP/s" if check["mfu"] is not None else "MFU n/a"
    generated = f", {check['gen_tokens_per_s']:.0f} generated tokens/s" if "gen_tokens_per_s" in check else ""
    copy = check.get("device_copy_gb_per_s", check.get("device_to_host_copy_gb_per_s"))
    print(
        f"{label}: {check['train_tflops_per_s']:.3f} TFLOP/s in training ({mfu}){generated}, weight sync "
        f"{check['sync_gb_per_s']:.2f} GB/s vs a copy {copy:.1f} GB/s; {check['step_s']:.2f} s/step"
    )


def check_consistency(args, tmp: Path, peak: float | None) -> dict:
    """The consistency certificate (`python -m rl_tpu.consistency`, 4 fixed sequences of 16 tokens) of the tiny
    model in fp32 and bf16, and of the trainer shape's model (2 sequences of 8 tokens) in bf16, each added to
    benchmarks/results/consistency_<device>_<model>.json and .md; needs vLLM and Ray, else skipped, saying so."""
    if not (installed("vllm") and installed("ray")):
        return {"skipped": "the consistency certificate needs vLLM and Ray, which this host lacks"}
    from rl_tpu.consistency import main as certify

    tiny = trainer_model("tiny", tmp / "consistency-tiny")
    runs = [("tiny", [f"model.path={tiny}", f"model.dtype={dtype}"]) for dtype in ("float32", "bfloat16")]
    if args.trainer_shape != "tiny":
        shape = trainer_model(args.trainer_shape, tmp / f"consistency-{args.trainer_shape}")
        runs.append(
            (args.trainer_shape, [f"model.path={shape}", "model.dtype=bfloat16", "--sequences=2", "--length=8"])
        )
    out = ["--out", str(REPO / "benchmarks" / "results")]
    status = {
        f"{model} {settings[1]}": certify(
            [f"device={args.device}", *settings, *out, f"--name=consistency_{args.device}_{model}"]
        )
        for model, settings in runs
    }
    names = sorted({f"consistency_{args.device}_{model}" for model, _ in runs})
    return {"exit_status": status, "records": names}


CHECKS = {
    "tiny": check_tiny,
    "real_size": check_real_size,
    "trainer": check_trainer,
    "ipc": check_ipc,
    "consistency": check_consistency,
}


def installed(module: str) -> bool:
    """Whether `module` imports: the lent GPU machines have neither Ray nor vLLM (the object_store publish and the
    consistency certificate are left out there)."""
    try:
        __import__(module)
    except ImportError:
        return False
    return True


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--checks", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--warm-start-steps", type=int, default=0, help="the tiny model's supervised warm start")
    parser.add_argument("--gsm8k", type=Path, default=REPO.parent / "shared" / "data" / "gsm8k")
    trainer = parser.add_argument_group("the trainer check")
    trainer.add_argument("--trainer-shape", choices=["tiny", "0.5b", "3b"], default="0.5b")
    trainer.add_argument("--prompts", type=int, default=32)
    trainer.add_argument("--n", type=int, default=8, help="sequences a prompt")
    trainer.add_argument("--prompt-len", type=int, default=128)
    trainer.add_argument("--completion-len", type=int, default=512)
    trainer.add_argument("--micro-batch-size", type=int, default=16)
    trainer.add_argument("--compile", action="store_true", help="trainer.compile")
    trainer.add_argument("--profile", action="store_true", help="profile one more step: where its time goes")
    trainer.add_argument(
        "--transports",
        nargs="+",
        choices=["shm_file", "object_store"],
        default=None,
        help="publish and fetch through each (the first is the figure printed); default: both where Ray is "
        "installed, else shm_file",
    )
    trainer.add_argument(
        "--set",
        nargs="*",
        default=[],
        metavar="KEY=VALUE",
        help="run settings over the check's own, e.g. trainer.logprob_chunk_size=512",
    )
    parser.add_argument("--bucket-mb", type=float, default=512.0, help="the ipc check's buckets (sync.bucket_mb)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    args.transports = args.transports or (["shm_file", "object_store"] if installed("ray") else ["shm_file"])
    out = args.out or REPO / "benchmarks" / "results" / f"device_check_{args.device}.json"
    load_before = os.getloadavg()
    name, peak = bf16_peak_tflops(args.device)
    checks = {}
    with tempfile.TemporaryDirectory() as tmp:
        for label, check in CHECKS.items():  # in this order, whatever the order asked
            if label in args.checks:
                checks[label] = check(args, Path(tmp), peak)
                report(label, checks[label], peak)
    return write_record(
        out,
        load_before,
        device=args.device,
        accelerator=name,
        bf16_peak_tflops=peak,
        args={k: str(v) for k, v in vars(args).items()},
        checks=checks,
    )


if __name__ == "__main__":
    main()
