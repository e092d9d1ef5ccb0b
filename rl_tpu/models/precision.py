"""An fp32 residual stream for bf16 runs, in the trainer and in the CPU engine (`model.fp32_residual`).

Why: in bf16, each side rounds the residual stream (the running sum of every block's output) to
bf16 after every add, and the two sides round differently. Over the 24 layers of a 0.5B model
this rounding is most of the sampler-trainer logprob gap: 8.1e-3 nats per token with both sides
bf16, 4.2e-3 with the sum kept in fp32 on both; generation is as fast, a CPU train step took
1.06-1.31x as long in a noisy comparison (`benchmarks/README.md`, logprob_gap.py).
Everything else (weights, matmuls, attention, the activations between them) stays bf16; this is
Megatron's `fp32_residual_connection`, for Hugging Face decoders and vLLM's RMSNorm.

Both sides normalise the fp32 sum as vLLM's native RMSNorm does: in fp32, rounded to the weight's
dtype, then scaled by the weight.
"""

from __future__ import annotations

import torch
from torch import nn

from rl_tpu.models.families import family_of


def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX on this host. Without either, PyTorch's bf16 matmul takes a scalar fallback:
    0.9 GFLOP/s against 56 in fp32 on one AVX2 core (AMD EPYC, benchmarks/README.md)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


def slow_bf16_warning(dtype: str) -> str | None:
    """Why bf16 would be slow on this host's CPU, or None."""
    if dtype != "bfloat16" or cpu_has_native_bf16():
        return None
    return (
        "model.dtype=bfloat16 on a CPU without native bf16 (AVX512-BF16 or AMX): its bf16 matmuls run about "
        "60x slower than fp32 (benchmarks/README.md); model.dtype=float32 trains faster here"
    )


def rms_norm_of_fp32(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x = x.float()
    x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return x.to(weight.dtype) * weight


class Fp32InputRMSNorm(nn.Module):
    """An RMSNorm that reads the fp32 residual stream and returns the compute dtype (its weight's).

    Keeps the wrapped norm's `weight` parameter, so state-dict names and checkpoints are unchanged."""

    def __init__(self, norm: nn.Module):
        super().__init__()
        self.weight, self.variance_epsilon = norm.weight, norm.variance_epsilon

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return rms_norm_of_fp32(hidden_states, self.weight, self.variance_epsilon)


def _residual_to_fp32(module: nn.Module, args: tuple, kwargs: dict):
    """Before a block: its input, the residual stream, in fp32 (a no-op after the first block)."""
    if args:
        return (args[0].float(), *args[1:]), kwargs
    return args, {**kwargs, "hidden_states": kwargs["hidden_states"].float()}


def keep_residual_fp32(model: nn.Module) -> None:
    """Make a Hugging Face decoder carry its residual stream in fp32 while it computes in bf16: its family's record
    says which norms read the stream (`families.ModelFamily.residual_norms`).

    The first block's input is cast to fp32; each block's `residual + output` then stays fp32 by
    type promotion, and its norms (and the final norm) hand bf16 to the layers that follow them.
    Under FSDP2 the blocks must not cast their inputs to bf16 (`apply_fsdp(cast_block_inputs=False)`).
    """
    family = family_of(model)
    norms = family.residual_norms(model)
    unknown = [
        f"{type(getattr(owner, name, None)).__name__} at .{name}"
        for owner, name in norms
        if not hasattr(getattr(owner, name, None), "variance_epsilon")
    ]
    if unknown:
        raise TypeError(
            f"model.fp32_residual: {type(model).__name__} lacks the Llama/Qwen-style RMSNorms it needs "
            f"({', '.join(sorted(set(unknown)))}); set model.fp32_residual=false"
        )
    for owner, name in norms:
        setattr(owner, name, Fp32InputRMSNorm(getattr(owner, name)))
    for layer in family.decoder_layers(model):
        layer.register_forward_pre_hook(_residual_to_fp32, with_kwargs=True)


def keep_vllm_residual_fp32() -> None:
    """In an engine's process, before the engine is built: vLLM's fused add + RMSNorm keeps the sum in fp32.

    vLLM's own `fused_add_rms_norm` adds in fp32 but returns the sum rounded to the model's dtype,
    which the next block adds to. Only the CPU platform is patched: there RMSNorm runs this native
    path; a GPU engine keeps vLLM's fused kernel (and a bf16 residual), which has not been measured.
    """
    from vllm.model_executor.layers.layernorm import RMSNorm

    native = RMSNorm.forward_native
    if getattr(native, "keeps_residual_fp32", False):
        return

    def forward_native(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        if residual is None or not self.has_weight or self.variance_size_override is not None:
            return native(self, x, residual)
        summed = x.float() + residual.float()
        return rms_norm_of_fp32(summed, self.weight.data, self.variance_epsilon).to(x.dtype), summed

    forward_native.keeps_residual_fp32 = True
    RMSNorm.forward_native = forward_native
