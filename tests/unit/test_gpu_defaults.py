"""Defaults that follow the device: the engine's KV cache and compilation, the object store's size."""

from __future__ import annotations

import dataclasses

import torch

from rl_tpu.cluster.placement import object_store_bytes
from rl_tpu.config import RayConfig, RunConfig
from rl_tpu.models.hf import bundle_bytes
from rl_tpu.sampler.engine import memory_args

GiB = 2**30


def test_the_kv_cache_is_bytes_where_set_else_1_gib_on_cpu_and_the_devices_share_elsewhere():
    assert memory_args(None, None, on_cpu=True) == {"kv_cache_memory_bytes": GiB}
    assert memory_args(None, 0.85, on_cpu=True) == {"kv_cache_memory_bytes": GiB}  # no device share on CPU
    assert memory_args(2.0, None, on_cpu=True) == {"kv_cache_memory_bytes": 2 * GiB}
    assert memory_args(None, 0.4, on_cpu=False) == {"gpu_memory_utilization": 0.4}
    assert memory_args(None, None, on_cpu=False) == {}  # vLLM's own default
    assert memory_args(16.0, 0.4, on_cpu=False) == {"kv_cache_memory_bytes": 16 * GiB}  # the user's bytes win


def test_engines_run_eagerly_on_cpu_and_compiled_with_cuda_graphs_on_accelerators():
    cfg = RunConfig()
    assert dataclasses.replace(cfg, device="cpu").engine_eager
    assert not dataclasses.replace(cfg, device="cuda").engine_eager
    cfg.sampler.enforce_eager = True
    assert dataclasses.replace(cfg, device="cuda").engine_eager
    cfg.sampler.enforce_eager = False
    assert not dataclasses.replace(cfg, device="cpu").engine_eager


def test_the_object_store_holds_two_bundles_unless_set(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    fp32 = sum(p.numel() for p in model.parameters()) * 4  # a tied head once
    assert bundle_bytes(tiny_model_dir, torch.float32) == fp32
    assert bundle_bytes(tiny_model_dir, torch.bfloat16) * 2 == fp32
    assert object_store_bytes(RayConfig(), fp32) == 512 * 2**20  # a small model: the floor
    three_gb = 3 * 10**9  # a 1.5B model's bf16 bundle
    assert object_store_bytes(RayConfig(), three_gb) == 2 * three_gb + 256 * 2**20
    assert object_store_bytes(RayConfig(object_store_mb=1024), three_gb) == 1024 * 2**20
