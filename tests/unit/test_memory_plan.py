"""The memory plan's arithmetic against the recorded peaks of benchmarks/results/, its refusal and its layouts."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from rl_tpu.cluster import memory_items
from rl_tpu.cluster.memory_items import GiB
from rl_tpu.config import RunConfig, TrainerConfig
from rl_tpu.controller import memory_plan
from rl_tpu.models.families import model_shape
from rl_tpu.models.shape import ModelShape
from rl_tpu.sampler import memory as engine_memory
from rl_tpu.trainer import memory as trainer_memory

RESULTS = Path(__file__).resolve().parents[2] / "benchmarks" / "results"
QWEN_05B = {  # Qwen2.5-0.5B's config.json sizes, as benchmarks/real_size.py builds the model
    "hidden_size": 896,
    "num_hidden_layers": 24,
    "intermediate_size": 4864,
    "num_attention_heads": 14,
    "num_key_value_heads": 2,
    "vocab_size": 151_936,
    "tie_word_embeddings": True,
}
QWEN_15B = {**QWEN_05B, "hidden_size": 1536, "num_hidden_layers": 28, "intermediate_size": 8960}
QWEN_15B |= {"num_attention_heads": 12}
QWEN_3B = {**QWEN_05B, "hidden_size": 2048, "num_hidden_layers": 36, "intermediate_size": 11008}
QWEN_3B |= {"num_attention_heads": 16}
QWEN_7B = {**QWEN_05B, "hidden_size": 3584, "num_hidden_layers": 28, "intermediate_size": 18944}  # Qwen2.5-7B's
QWEN_7B |= {"num_attention_heads": 28, "num_key_value_heads": 4, "vocab_size": 152_064, "tie_word_embeddings": False}
QWEN_14B = {**QWEN_7B, "hidden_size": 5120, "num_hidden_layers": 48, "intermediate_size": 13824}
QWEN_14B |= {"num_attention_heads": 40, "num_key_value_heads": 8}
CPU_TOLERANCE = 0.15  # a trainer rank's peak resident memory on CPU: the four recorded runs came to -6%..+10%
GPU_TOLERANCE = 0.25  # torch's peak allocation on one H200: -20% (0.5B) and -3% (3B)
# the memory torch reports of a device (GiB): a 24 GB card, an 80 GB H100, the H200 of the recorded runs
GPU_24GB, H100, H200 = 23.6, 79.1, 139.8


def record(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def shape(config: dict, result: str) -> ModelShape:
    """The model's sizes, and its parameter count as the GPU check counted it (the weight files' headers)."""
    return ModelShape.from_config(config, record(result)["checks"]["trainer"]["parameters"])


def qwen_05b() -> ModelShape:
    return shape(QWEN_05B, "device_check_cuda_trainer_0.5b.json")


def real_size_run(world_size: int, new_tokens: int, lora_rank: int = 0) -> RunConfig:
    """benchmarks/real_size.py's settings (lora_sync.py's too): bf16 served, checkpointed, micro-batches of 2."""
    cfg = RunConfig()
    cfg.device, cfg.model.dtype = "cpu", "bfloat16"
    cfg.data.max_prompt_length, cfg.sampler.response_length, cfg.sampler.kv_cache_gb = 512, new_tokens, 0.5
    cfg.trainer.world_size, cfg.trainer.micro_batch_size, cfg.trainer.activation_checkpointing = world_size, 2, True
    if lora_rank:
        cfg.actor.lora.lora_rank, cfg.actor.lora.lora_alpha = lora_rank, 2 * lora_rank
    return cfg


def trainer_rank_0(plan: memory_plan.MemoryPlan) -> memory_plan.Process:
    return next(p for budget in plan.budgets for p in budget.processes if p.name.startswith("trainer rank 0"))


def cpu_peak(cfg: RunConfig) -> float:
    """Trainer rank 0's planned peak in GiB; on CPU it counts the bundle it published, as its resident memory does."""
    return trainer_rank_0(memory_plan.build(cfg, qwen_05b(), "cpu", 64 * GiB)).bytes / GiB


def test_full_fine_tuning_and_lora_land_near_the_measured_cpu_peaks():
    runs = record("lora_sync.json")["runs"]
    full, lora = cpu_peak(real_size_run(1, 32)), cpu_peak(real_size_run(1, 32, lora_rank=16))
    assert full == pytest.approx(runs["full"]["trainer_rank_peak_rss_mb"][0] / 1024, rel=CPU_TOLERANCE)
    assert lora == pytest.approx(runs["lora"]["trainer_rank_peak_rss_mb"][0] / 1024, rel=CPU_TOLERANCE)
    assert lora < full / 2  # no gradient or AdamW state for the frozen base (measured: 0.29 of full's)


@pytest.mark.parametrize("world_size", [1, 2])
def test_each_world_sizes_ranks_land_near_the_measured_cpu_peaks(world_size):
    run = next(r for r in record("real_size.json")["runs"] if r["world_size"] == world_size)
    measured = max(run["trainer_rank_peak_rss_mb"]) / 1024
    assert cpu_peak(real_size_run(world_size, 128)) == pytest.approx(measured, rel=CPU_TOLERANCE)


@pytest.mark.parametrize(
    ("config", "size", "low", "high"), [(QWEN_05B, "0.5b", 0.70, 1.0), (QWEN_15B, "1.5b", 0.9, 1.1)]
)
def test_a_cpu_engine_lands_near_its_measured_peak(config, size, low, high):
    """benchmarks/engine_memory.py: vLLM's CPU engine (rl_tpu's Sampler) at two sizes. At 1.5B the peak is the
    loading (weights beside their mapped files); at 0.5B serving, where the plan leaves out glibc's retention and
    most of the benchmark tokenizer's 151k added tokens (docs/performance.md#the-memory-plan)."""
    run = record("engine_memory.json")["runs"][size]
    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.sampler.kv_cache_gb = (
        "cpu",
        "bfloat16",
        record("engine_memory.json")["args"]["kv_cache_gb"],
    )
    phases = engine_memory.phases(cfg, ModelShape.from_config(config, run["parameters"]), "cpu", None, 0.0)
    peak = max(sum(item.bytes for item in items) for items in phases.values()) / GiB
    assert low <= peak / run["peak_rss_gib"] <= high


@pytest.mark.parametrize(
    ("config", "result", "micro_batch"),
    [(QWEN_05B, "device_check_cuda_trainer_0.5b.json", 16), (QWEN_3B, "device_check_cuda_trainer_3b.json", 8)],
)
def test_a_gpu_trainer_lands_near_the_recorded_peak_allocation(config, result, micro_batch):
    plan = memory_plan.build(device_check_trainer(micro_batch), shape(config, result), "cuda", int(H200 * GiB))
    process, *allocated, slack = trainer_rank_0(plan).items  # torch's count has no CUDA context, no cached blocks
    assert process.what.startswith("process") and slack.what.startswith("the caching allocator's slack")
    planned = sum(item.bytes for item in allocated) / GiB
    assert planned == pytest.approx(record(result)["checks"]["trainer"]["peak_memory_gib"], rel=GPU_TOLERANCE)


def device_check_trainer(micro_batch: int) -> RunConfig:
    """device_check.py's trainer check: bf16, prompts of 128, completions of up to 512."""
    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.trainer.micro_batch_size = "cuda", "bfloat16", micro_batch
    cfg.data.max_prompt_length, cfg.sampler.response_length = 128, 512
    return cfg


def test_the_recorded_h200_runs_fit_it_and_the_3b_run_is_refused_on_an_80_gb_gpu():
    """Both recorded runs ran on an H200; the 3B one peaked at 78.8 GiB allocated, which with a CUDA context and the
    allocator's cached blocks does not fit the 79.1 GiB an 80 GB H100 offers."""
    for config, result, micro_batch in [(QWEN_05B, "0.5b", 16), (QWEN_3B, "3b", 8)]:
        run = shape(config, f"device_check_cuda_trainer_{result}.json")
        assert memory_plan.build(device_check_trainer(micro_batch), run, "cuda", int(H200 * GiB)).refusal() is None
    plan = memory_plan.build(device_check_trainer(8), run, "cuda", int(H100 * GiB))
    assert (
        trainer_rank_0(plan).bytes / GiB
        > record("device_check_cuda_trainer_3b.json")["checks"]["trainer"]["peak_memory_gib"]
        + memory_items.DEVICE_PROCESS / GiB
    )
    why = plan.refusal()
    assert why is not None and "the GPU of trainer rank 0" in why and "trainer.micro_batch_size" in why


def lora_run(host_gib: float, config: dict, parameters: int, device_gib: float) -> memory_plan.MemoryPlan:
    """A LoRA run on one GPU: rank 16, bf16, checkpointed, micro-batches of 2 x (512 + 1024) tokens."""
    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.actor.lora.lora_rank, cfg.actor.lora.lora_alpha = "cuda", "bfloat16", 16, 32
    cfg.data.max_prompt_length, cfg.sampler.response_length = 512, 1024
    cfg.trainer.micro_batch_size, cfg.trainer.activation_checkpointing = 2, True
    model = ModelShape.from_config(config, parameters)
    return memory_plan.build(cfg, model, "cuda", int(device_gib * GiB), "disaggregated", int(host_gib * GiB))


def test_rank_0_reads_the_whole_model_into_host_memory_not_onto_its_gpu():
    """`TrainerWorker._load_model` reads the checkpoint in fp32 on the host and sends a tensor at a time: a 7B LoRA
    run fits a 24 GB GPU and a 14B one an 80 GB GPU, and the host, checked on every run, holds the fp32 model."""
    seven, fourteen = (QWEN_7B, 7_615_616_512), (QWEN_14B, 14_770_033_664)
    for (config, parameters), device_gib in [(seven, GPU_24GB), (fourteen, H100)]:
        plan = lora_run(128, config, parameters, device_gib)
        assert plan.refusal() is None
        host_rank_0 = next(p for p in plan.budgets[-1].processes if p.name.startswith("trainer rank 0"))
        assert host_rank_0.name == "trainer rank 0, loading" and host_rank_0.items[-1].bytes > 4 * parameters
    host = lora_run(24, *seven, GPU_24GB)
    why = host.refusal()
    assert why is not None and "on this host" in why and "the whole model in fp32, once 28.52 GiB" in why


def test_each_transport_keeps_what_its_code_keeps_on_the_devices():
    """cuda_ipc keeps the version before beside the last one; nccl's engine receives every bucket of a bundle into
    buffers of its own, outside vLLM's share; a device checksum widens a bucket to int64 words (8 bytes a byte at
    its peak: profiled on CPU, 256 MiB bucket: the pad 256 MB, the int64 words 1 GB, their offset copy 1 GB)."""
    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.sampler.kv_cache_gb, cfg.sync.bucket_mb = "cuda", "bfloat16", 4.0, 256
    served = 2 * qwen_05b().parameters

    def items(transport: str, layout: str) -> dict[str, int]:
        cfg.sync.transport = transport
        plan = memory_plan.build(cfg, qwen_05b(), "cuda", int(H100 * GiB), layout, 64 * GiB)
        return {i.what: i.bytes for budget in plan.budgets[:-1] for p in budget.processes for i in p.items}

    ipc = items("cuda_ipc", "colocated")
    assert ipc["its share of the weights it published, the last 2 versions"] == 2 * served
    nccl = items("nccl", "disaggregated")
    assert nccl["its share of the weights it published"] == served
    assert nccl["the bundle's buckets, as received"] == served
    assert nccl["a bucket's checksum, its int64 words"] == 8 * 256 * 2**20 + memory_items.CHECKSUM_WORK
    assert "the bundle's buckets, as received" not in ipc  # an engine opens the trainer's buffers where they lie


def test_a_layout_that_cannot_fit_is_refused_naming_the_keys_to_change(caplog):
    cfg = RunConfig()
    cfg.model.dtype, cfg.data.max_prompt_length, cfg.sampler.response_length = "bfloat16", 512, 1024
    plan = memory_plan.build(cfg, qwen_05b(), "cuda", 24 * GiB)
    why = plan.refusal()
    assert why is not None and "the GPU of trainer rank 0" in why and "24.00 GiB" in why
    for key in ("trainer.micro_batch_size", "trainer.activation_checkpointing", "trainer.memory_check=warn"):
        assert key in why
    with pytest.raises(ValueError, match="trainer.micro_batch_size"):
        memory_plan.enforce(plan, "refuse")
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        memory_plan.enforce(plan, "warn")  # logs the plan and the reason, and lets the run start
    assert "memory plan" in caplog.text and "trainer.micro_batch_size" in caplog.text
    cfg.actor.lora.lora_rank, cfg.trainer.micro_batch_size, cfg.trainer.activation_checkpointing = 16, 4, True
    assert memory_plan.build(cfg, qwen_05b(), "cuda", 24 * GiB).refusal() is None


def test_a_colocated_gpu_holds_trainer_and_engine_and_the_host_sums_every_process():
    cfg = RunConfig()
    cfg.model.dtype, cfg.sampler.kv_cache_gb = "bfloat16", 4.0
    apart = memory_plan.build(cfg, qwen_05b(), "cuda", 80 * GiB, "disaggregated")
    together = memory_plan.build(cfg, qwen_05b(), "cuda", 80 * GiB, "colocated").budgets
    assert [b.name for b in apart.budgets] == ["the GPU of trainer rank 0", "each engine's GPU", "this host"]
    assert len(together) == 2 and len(together[0].processes) == 2 and together[1].name == "this host"
    trainer, engine = together[0].processes
    assert together[0].total == trainer.bytes + engine.bytes
    # the engine sleeps while the trainer trains: the device holds the larger of the two sums
    training = trainer_rank_0(apart).bytes + memory_items.DEVICE_PROCESS
    generating = sum(i.bytes for i in trainer_memory.phases(cfg, qwen_05b(), "cuda", 0)["between steps"])
    generating += apart.budgets[1].total
    assert together[0].total == max(training, generating)
    cfg.trainer.world_size, cfg.sampler.num_engines = 2, 2
    host = memory_plan.build(cfg, qwen_05b(), "cpu", 64 * GiB).budgets[0]
    assert [p.count for p in host.processes] == [1, 1, 1, 2]  # driver, rank 0, rank 1, the engines
    assert host.total == sum(p.bytes * p.count for p in host.processes)
    assert "trainer.world_size" in host.advice and "sampler.num_engines" in host.advice


def test_the_plan_reads_the_model_folder_and_lines_show_each_item(tiny_model_dir, caplog):
    cfg = RunConfig()
    cfg.device = "cpu"
    with caplog.at_level(logging.INFO, logger=memory_plan.__name__):
        memory_plan.check(cfg, tiny_model_dir)
    assert "this host" in caplog.text and "AdamW's two fp32 states" in caplog.text and "KV cache" in caplog.text
    folder = model_shape(tiny_model_dir)
    config = json.loads((tiny_model_dir / "config.json").read_text())
    assert folder.parameters > 0 and folder.hidden == config["hidden_size"]
    cfg.trainer.memory_check = "off"
    caplog.clear()
    memory_plan.check(cfg, tiny_model_dir)
    assert "memory plan" not in caplog.text


def test_memory_check_takes_its_three_values_only():
    with pytest.raises(ValueError, match="trainer.memory_check='maybe': allowed values are refuse, warn, off"):
        TrainerConfig(memory_check="maybe")


def test_an_engine_over_several_devices_holds_a_shard_of_the_weights_on_each():
    cfg = RunConfig()
    cfg.model.dtype, cfg.sampler.kv_cache_gb = "bfloat16", 4.0
    whole = engine_memory.phases(cfg, qwen_05b(), "cuda", 80 * GiB, 0.85)["generating"]
    cfg.sampler.tensor_parallel_size = 2
    half = engine_memory.phases(cfg, qwen_05b(), "cuda", 80 * GiB, 0.85)["generating"]
    assert half[1].bytes == whole[1].bytes // 2 and "sampler.tensor_parallel_size" in half[1].keys
    assert half[2].bytes == whole[2].bytes  # each device's cache
    host = memory_plan.build(cfg, qwen_05b(), "cpu", 64 * GiB).budgets[0]
    assert host.processes[-1].count == 2 and host.processes[-1].name.startswith("engine worker")
