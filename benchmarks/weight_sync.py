"""Weight-sync transports between two processes, against an in-process copy of the same bytes.

For each model (DESIGN.md's 3.3M reference model in fp32, and a ~0.5B Qwen3-shaped state dict in
bf16), each CPU transport moves the full weights from a sender actor to a receiver actor:
pack (bucket, checksum, stage) on the sender, then fetch and verify every bucket on the
receiver, which ends holding the tensors. The floor is `copy_` of the same tensors into
preallocated buffers in one process. Engine install (`reload_weights`) is not included: it is
the same for every transport. Timings are medians of `--repeats` after one warm-up.

`rdt_gloo` evaluates Ray Direct Transport (`@ray.method(tensor_transport="gloo")`, Ray 2.60)
on the same buckets: the sender returns each bucket's tensors out of band with the same
checksums, and the receiver (an actor with `enable_tensor_transport=True`; without it the
receiving call blocks the thread that would run the transfer, and Ray gives up after 60 s)
verifies every checksum. It is measured here only: see benchmarks/README.md for why the
project keeps its own transports.

    python benchmarks/weight_sync.py            # writes benchmarks/results/weight_sync.json
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import ray
import torch
from record import write_record  # beside this script

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from rl_tpu.records import WeightBundle
from rl_tpu.sync.bundle import checksum, plan_buckets, spec_of
from rl_tpu.sync.endpoints import pack, unpack
from rl_tpu.sync.registry import CPU_TRANSPORTS, make_transport

MODELS = {
    # name: (Qwen3 config overrides, dtype)
    "reference-3.3M": (
        dict(
            vocab_size=268,
            hidden_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=64,
            intermediate_size=768,
        ),
        torch.float32,
    ),
    "qwen3-0.5B": (
        dict(
            vocab_size=151936,
            hidden_size=1024,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=64,
            intermediate_size=3072,
        ),
        torch.bfloat16,
    ),
}


def make_state_dict(overrides: dict, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Random tensors with the names and shapes of a tied Qwen3ForCausalLM built from config."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    with torch.device("meta"):
        model = Qwen3ForCausalLM(Qwen3Config(tie_word_embeddings=True, **overrides))
    generator = torch.Generator().manual_seed(0)
    return {
        name: torch.randn(p.shape, generator=generator).to(dtype)
        for name, p in model.state_dict().items()
        if name != "lm_head.weight"
    }


@ray.remote(num_cpus=1)
class Sender:
    def __init__(self, overrides: dict, dtype: str):
        self.state = make_state_dict(overrides, getattr(torch, dtype))
        self.transports = {}  # one per kind, kept across versions, as the trainer does

    def num_bytes(self) -> int:
        return sum(t.nbytes for t in self.state.values())

    def send(self, transport: str, version: int, bucket_mb: float, shm_dir: str) -> tuple[WeightBundle, float]:
        if transport not in self.transports:
            self.transports[transport] = make_transport(transport, shm_dir)
        start = time.perf_counter()
        bundle = pack(self.state, version, self.transports[transport], bucket_mb)
        return bundle, time.perf_counter() - start

    def copy_floor(self) -> float:
        """The same bytes copied once inside this process, into buffers allocated beforehand."""
        targets = {name: torch.empty_like(t) for name, t in self.state.items()}
        start = time.perf_counter()
        for name, tensor in self.state.items():
            targets[name].copy_(tensor)
        return time.perf_counter() - start


@ray.remote(num_cpus=1)
class Receiver:
    def receive(self, bundle: WeightBundle) -> float:
        start = time.perf_counter()
        tensors, _ = unpack(bundle)
        assert len(tensors) == len(bundle.names)
        return time.perf_counter() - start


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.detach().contiguous().view(-1).view(torch.uint8)


@ray.remote(num_cpus=1)
class RdtSender:
    def __init__(self, overrides: dict, dtype: str):
        self.state = make_state_dict(overrides, getattr(torch, dtype))

    @ray.method(tensor_transport="gloo")
    def send(self, bucket_mb: float) -> list:
        """The bundle's buckets as (specs, checksum, byte tensors); the tensors travel over gloo."""
        buckets = []
        for names in plan_buckets({n: t.nbytes for n, t in self.state.items()}, int(bucket_mb * 2**20)):
            specs = tuple(spec_of(n, self.state[n]) for n in names)
            tensors = [as_bytes(self.state[n]) for n in names]
            buckets.append((specs, checksum(specs, [t.numpy() for t in tensors]), tensors))
        return buckets


@ray.remote(num_cpus=1, enable_tensor_transport=True)
class RdtReceiver:
    def receive(self, buckets: list) -> int:
        for specs, expected, tensors in buckets:
            assert checksum(specs, [t.numpy() for t in tensors]) == expected, "checksum mismatch"
        return len(buckets)


def measure_rdt(model: str, repeats: int, bucket_mb: float) -> float:
    from ray.experimental.collective import create_collective_group, destroy_collective_group

    overrides, dtype = MODELS[model]
    sender, receiver = RdtSender.remote(overrides, str(dtype).removeprefix("torch.")), RdtReceiver.remote()
    group = create_collective_group([sender, receiver], backend="gloo")
    totals = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        ray.get(receiver.receive.remote(sender.send.remote(bucket_mb)), timeout=600)
        totals.append(time.perf_counter() - start)
    destroy_collective_group(group)
    ray.kill(sender)
    ray.kill(receiver)
    return statistics.median(totals[1:])


def measure(model: str, transports: list[str], repeats: int, bucket_mb: float, shm_dir: str) -> dict:
    overrides, dtype = MODELS[model]
    sender, receiver = Sender.remote(overrides, str(dtype).removeprefix("torch.")), Receiver.remote()
    num_bytes = ray.get(sender.num_bytes.remote())
    floors = [ray.get(sender.copy_floor.remote()) for _ in range(repeats + 1)][1:]
    result = {
        "bytes": num_bytes,
        "dtype": str(dtype).removeprefix("torch."),
        "floor": {"seconds": statistics.median(floors), "mb_per_s": num_bytes / 2**20 / statistics.median(floors)},
    }
    for transport in (t for t in transports if t in CPU_TRANSPORTS):
        totals = []
        for version in range(1, repeats + 2):
            start = time.perf_counter()
            bundle, _ = ray.get(sender.send.remote(transport, version, bucket_mb, shm_dir))
            ray.get(receiver.receive.remote(bundle))
            totals.append(time.perf_counter() - start)
            del bundle
        seconds = statistics.median(totals[1:])
        result[transport] = {
            "seconds": seconds,
            "mb_per_s": num_bytes / 2**20 / seconds,
            "ratio_to_floor": result["floor"]["seconds"] / seconds,
        }
    ray.kill(sender)
    ray.kill(receiver)
    if "rdt_gloo" in transports:
        seconds = measure_rdt(model, repeats, bucket_mb)
        result["rdt_gloo"] = {
            "seconds": seconds,
            "mb_per_s": num_bytes / 2**20 / seconds,
            "ratio_to_floor": result["floor"]["seconds"] / seconds,
        }
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    choices = [*CPU_TRANSPORTS, "rdt_gloo"]
    parser.add_argument("--transports", nargs="+", default=choices, choices=choices)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=512.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "weight_sync.json"))
    args = parser.parse_args()

    ray.init(address="local", num_cpus=3, include_dashboard=False, object_store_memory=3 * 2**30, log_to_driver=False)
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(dir="/dev/shm") as shm_dir:
        results = {m: measure(m, args.transports, args.repeats, args.bucket_mb, shm_dir) for m in args.models}
    ray.shutdown()
    write_record(args.out, load_before, repeats=args.repeats, bucket_mb=args.bucket_mb, models=results)
    print(f"median of {args.repeats}")
    print(f"{'model':16} {'transport':13} {'MB':>8} {'seconds':>8} {'MB/s':>8} {'vs copy':>8}")
    for model, r in results.items():
        for name in ["floor", *args.transports]:
            row = r[name]
            ratio = f"{row.get('ratio_to_floor', 1.0):.2f}"
            print(
                f"{model:16} {name:13} {r['bytes'] / 2**20:8.1f} {row['seconds']:8.4f} {row['mb_per_s']:8.0f} {ratio:>8}"
            )


if __name__ == "__main__":
    main()
