"""TorchTitan-style parallelisation of a Hugging Face decoder: each technique is one small function."""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard

from rl_tpu.cluster.device import Device
from rl_tpu.models.families import decoder_layers
from rl_tpu.models.precision import keep_residual_fp32


def apply_activation_checkpointing(model: nn.Module) -> None:
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def apply_compile(model: nn.Module, device: Device) -> None:
    """Compile each block separately: identical blocks share one compiled graph.

    Dynamo counts a block's variants (per layer index, with and without a prompt's KV prefix
    (`trainer.share_prompts`), static then dynamic shapes, and per thread count where a rank borrows
    idle engine cores) against one limit for the shared code; at its default of 8 the later variants
    run uncompiled, so allow 16 per block."""
    layers = decoder_layers(model)
    torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 16 * len(layers))
    for layer in layers:
        layer.compile(backend=device.compile_backend, fullgraph=False)


def apply_fp32_residual(model: nn.Module) -> None:
    keep_residual_fp32(model)


def apply_fsdp(model: nn.Module, mesh: DeviceMesh, param_dtype: torch.dtype, cast_block_inputs: bool = True) -> None:
    """`fully_shard` each decoder block, then the root (embeddings, final norm, head).

    `cast_block_inputs=False` leaves a block's inputs in their dtype (an fp32 residual stream)."""
    low_precision = param_dtype != torch.float32
    mp_policy = MixedPrecisionPolicy(
        param_dtype=param_dtype if low_precision else None, reduce_dtype=torch.float32 if low_precision else None
    )
    block_policy = MixedPrecisionPolicy(
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype, cast_forward_inputs=cast_block_inputs
    )
    layers = decoder_layers(model)
    for i, layer in enumerate(layers):
        # The last block's parameters are needed again at once by the root's backward: keep them.
        fully_shard(layer, mesh=mesh, mp_policy=block_policy, reshard_after_forward=i < len(layers) - 1)
    fully_shard(model, mesh=mesh, mp_policy=mp_policy)


def parallelize(
    model: nn.Module,
    device: Device,
    mesh: DeviceMesh,
    param_dtype: torch.dtype,
    activation_checkpointing: bool,
    compile: bool,
    fp32_residual: bool = False,
) -> nn.Module:
    """`fp32_residual` applies to low-precision parameters only (in fp32 everything is fp32 already)."""
    fp32_residual = fp32_residual and param_dtype != torch.float32
    if fp32_residual:
        apply_fp32_residual(model)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model, device)
    # One fp32 rank has nothing to shard or cast: as in TorchTitan at dp_shard=1, no FSDP, whose per-block gathers
    # and DTensor dispatch took 5% of the reference workload's train step (0.95 of it without them, on one core)
    if mesh.size() > 1 or param_dtype != torch.float32:
        apply_fsdp(model, mesh, param_dtype, cast_block_inputs=not fp32_residual)
    return model


def materialize(model: nn.Module, device: torch.device) -> None:
    """Storage on `device` for a model built on the meta device (values still to be loaded).

    `to_empty` gives each module holding a shared parameter (a tied head) its own copy; FSDP keeps one, and
    an unsharded model is tied again."""
    model.to_empty(device=device)
    if not isinstance(model, FSDPModule) and getattr(model.config, "tie_word_embeddings", False):
        model.tie_weights()
