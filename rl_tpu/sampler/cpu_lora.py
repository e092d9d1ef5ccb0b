"""vLLM's CPU LoRA kernels, fast when every token of a batch uses the same adapter (always so here: the engine serves
the newest version's adapter to every request), and right for base tokens.

vLLM's CPU build runs LoRA through pure-PyTorch ops that gather the adapter's weights once per token
(`weights[token_indices]`, a tokens x out x rank copy) and contract them with an einsum: 4.7x the generation time of
the same model without LoRA at the 0.5B shape (benchmarks/README.md, lora_sync.py). With one adapter for all tokens
the same product is one matmul. `use_one_matmul_per_adapter` replaces the three per-token ops (`bgmv_shrink`,
`bgmv_expand`, `bgmv_expand_slice`, which vLLM's prefill ops call too) with versions that make one matmul per
adapter in the batch. Written against vLLM 0.32's `vllm.lora.ops.torch_ops`.

A token of a request without an adapter has index -1, and vLLM's ops use it as a Python index: it selects the last
slot, so base tokens got the last slot's adapter (vLLM PRs #48421, #49656 are open). Here they get no adapter term
(what an all-zero adapter gives, and what the GPU kernels do), so a base request served beside adapter requests, or
after an adapter was installed, gets the base model's output.
"""

from __future__ import annotations

import torch

BASE = -1  # vLLM's index of a token whose request has no adapter


def adapter_products(inputs: torch.Tensor, weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype):
    """Each token's `inputs` row times its adapter's (out, in) weights transposed, in `dtype`: one matmul per adapter
    of the batch, and zeros for base tokens. `weights` is vLLM's stack (slots, [1,] out, in)."""
    inputs = inputs.to(dtype)
    first = int(indices[0]) if indices.numel() else BASE
    if first != BASE and bool((indices == first).all()):  # the serving case: one adapter for every token
        return inputs @ _slot(weights, first, dtype).T
    outputs = inputs.new_zeros(inputs.shape[0], weights.shape[-2])
    for slot in indices.unique().tolist():
        if slot != BASE:
            rows = indices == slot
            outputs[rows] = inputs[rows] @ _slot(weights, slot, dtype).T
    return outputs


def _slot(weights: torch.Tensor, slot: int, dtype: torch.dtype) -> torch.Tensor:
    selected = weights[slot].to(dtype)
    return selected.squeeze(0) if selected.dim() == 3 else selected


def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
    outputs = adapter_products(inputs, lora_a_weights, lora_indices_tensor, output_tensor.dtype)
    output_tensor[:, : outputs.shape[1]] = scaling * outputs


def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
    outputs = adapter_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    rows = output_tensor.shape[0] if outputs.shape[0] != 1 else 1  # vLLM's rule for a single-row product
    width = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
    if add_inputs:
        output_tensor[:, :width] += outputs[:rows, :width]
    else:
        output_tensor[:, :width] = outputs[:rows, :width]


def bgmv_expand_slice(
    inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True
):
    outputs = adapter_products(inputs, lora_b_weights, lora_indices_tensor, output_tensor.dtype)
    if add_inputs:
        output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
    else:
        output_tensor[:, slice_offset : slice_offset + slice_size] = outputs


OPS = {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def use_one_matmul_per_adapter() -> None:
    """Install the ops where vLLM's CPU punica wrapper and its prefill ops look them up (once per process)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_rl_tpu_one_matmul", False):
        return
    for name, op in OPS.items():
        setattr(lora_ops, name, op)  # vLLM's sgmv_* (prefill) call these through the module
        setattr(punica_cpu, name, op)  # its decode path imported them by name
    lora_ops._rl_tpu_one_matmul = True
