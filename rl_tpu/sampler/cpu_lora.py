"""vLLM's CPU LoRA kernels, fast when every token of a batch uses the same adapter (always so here: the engine serves
the newest version's adapter to every request).

vLLM's CPU build runs LoRA through pure-PyTorch ops that gather the adapter's weights once per token
(`weights[token_indices]`, a tokens x out x rank copy) and contract them with an einsum: 4.7x the generation time of
the same model without LoRA at the 0.5B shape (benchmarks/README.md, lora_sync.py). With one adapter for all tokens
the same product is one matmul. `use_one_matmul_per_adapter` replaces the three per-token ops (`bgmv_shrink`,
`bgmv_expand`, `bgmv_expand_slice`, which vLLM's prefill ops call too) with versions that take that path when the
tokens share an adapter and call vLLM's own otherwise. Written against vLLM 0.32's `vllm.lora.ops.torch_ops`.
"""

from __future__ import annotations

import torch


def shared_adapter(weights: torch.Tensor, indices: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """The (out, in) weights of the adapter every token uses, or None when the tokens use several."""
    if indices.numel() == 0 or not bool((indices == indices[0]).all()):
        return None
    selected = weights[indices[0]].to(dtype)  # the slot vLLM's gather would take for every token
    return selected.squeeze(0) if selected.dim() == 3 else selected


def one_matmul_ops(original: dict) -> dict:
    """`bgmv_shrink`, `bgmv_expand` and `bgmv_expand_slice` with the shared-adapter path; `original` holds vLLM's."""

    def bgmv_shrink(inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling=1.0):
        weights = shared_adapter(lora_a_weights, lora_indices_tensor, output_tensor.dtype)
        if weights is None:
            return original["bgmv_shrink"](inputs, lora_a_weights, output_tensor, lora_indices_tensor, scaling)
        outputs = inputs.to(output_tensor.dtype) @ weights.T
        output_tensor[:, : outputs.shape[1]] = scaling * outputs

    def bgmv_expand(inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs=True):
        weights = shared_adapter(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if weights is None:
            return original["bgmv_expand"](inputs, lora_b_weights, output_tensor, lora_indices_tensor, add_inputs)
        outputs = inputs.to(output_tensor.dtype) @ weights.T
        rows = output_tensor.shape[0] if outputs.shape[0] != 1 else 1  # vLLM's rule for a single-row product
        width = min(outputs.shape[1], output_tensor.shape[1])  # adapter and model may pad differently
        if add_inputs:
            output_tensor[:, :width] += outputs[:rows, :width]
        else:
            output_tensor[:, :width] = outputs[:rows, :width]

    def bgmv_expand_slice(
        inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs=True
    ):
        weights = shared_adapter(lora_b_weights, lora_indices_tensor, output_tensor.dtype)
        if weights is None:
            return original["bgmv_expand_slice"](
                inputs, lora_b_weights, output_tensor, lora_indices_tensor, slice_offset, slice_size, add_inputs
            )
        outputs = inputs.to(output_tensor.dtype) @ weights.T
        if add_inputs:
            output_tensor[:, slice_offset : slice_offset + slice_size] += outputs
        else:
            output_tensor[:, slice_offset : slice_offset + slice_size] = outputs

    return {"bgmv_shrink": bgmv_shrink, "bgmv_expand": bgmv_expand, "bgmv_expand_slice": bgmv_expand_slice}


def use_one_matmul_per_adapter() -> None:
    """Install the ops where vLLM's CPU punica wrapper and its prefill ops look them up (once per process)."""
    from vllm.lora.ops.torch_ops import lora_ops
    from vllm.lora.punica_wrapper import punica_cpu

    if getattr(lora_ops, "_rl_tpu_one_matmul", False):
        return
    original = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
    for name, op in one_matmul_ops(original).items():
        setattr(lora_ops, name, op)  # vLLM's sgmv_* (prefill) call these through the module
        setattr(punica_cpu, name, op)  # its decode path imported them by name
    lora_ops._rl_tpu_one_matmul = True
