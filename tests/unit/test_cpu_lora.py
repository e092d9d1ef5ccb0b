"""The one-matmul CPU LoRA ops give what vLLM's per-token ops give, for a shared adapter and for mixed ones, and
base tokens (index -1) get no adapter term, where vLLM's ops give them the last slot's adapter."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.sampler.cpu_lora import OPS, adapter_products

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
VLLM = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
TOKENS, HIDDEN, RANK, OUT = 7, 64, 8, 96


def run_ops(ops: dict, x, lora_a, lora_b, index, dtype) -> list[torch.Tensor]:
    """Every op's output for the same inputs: shrink, then expand and expand_slice with and without add_inputs."""
    shrunk = torch.zeros(len(index), RANK, dtype=torch.float32)
    ops["bgmv_shrink"](x, lora_a, shrunk, index, 0.5)
    outputs = [shrunk]
    for add in (True, False):
        expanded = torch.ones(len(index), OUT, dtype=dtype)
        ops["bgmv_expand"](shrunk, lora_b, expanded, index, add)
        sliced = torch.ones(len(index), OUT + 32, dtype=dtype)
        ops["bgmv_expand_slice"](shrunk, lora_b, sliced, index, 16, OUT, add)
        outputs += [expanded, sliced]
    return outputs


def adapters(dtype):
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(TOKENS, HIDDEN, generator=generator, dtype=dtype)
    lora_a = torch.randn(3, 1, RANK, HIDDEN, generator=generator, dtype=dtype)
    lora_b = torch.randn(3, 1, OUT, RANK, generator=generator, dtype=dtype)
    return x, lora_a, lora_b


def tolerance(dtype) -> dict:
    # fp32: outputs reach 50, so sums that cancel near 0 keep ~2e-6 of rounding that depends on the CPU's kernels
    return {"rtol": 1e-5, "atol": 5e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}


@pytest.mark.parametrize("indices", [[1] * 7, [0, 1, 1, 0, 2, 1, 0]], ids=["shared", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_equal_vllms_for_adapter_tokens(indices, dtype):
    x, lora_a, lora_b = adapters(dtype)
    index = torch.tensor(indices)
    for fast, slow in zip(
        run_ops(OPS, x, lora_a, lora_b, index, dtype), run_ops(VLLM, x, lora_a, lora_b, index, dtype)
    ):
        torch.testing.assert_close(fast, slow, **tolerance(dtype))


@pytest.mark.parametrize("indices", [[-1] * 7, [1, -1, 0, -1, 2, 1, -1]], ids=["base only", "base and adapters"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_base_tokens_get_the_base_output_beside_adapter_tokens(indices, dtype):
    """The reference is vLLM's op with an all-zero adapter in the slot that -1 selects (its last): that is the base
    model's output. vLLM's op on the real slots gives base tokens slot 2's adapter instead."""
    x, lora_a, lora_b = adapters(dtype)
    index = torch.tensor(indices)
    with_zero_slot = [torch.cat([w, torch.zeros_like(w[:1])]) for w in (lora_a, lora_b)]
    expected = run_ops(VLLM, x, *with_zero_slot, index, dtype)
    served = run_ops(OPS, x, lora_a, lora_b, index, dtype)
    for fast, reference in zip(served, expected):
        torch.testing.assert_close(fast, reference, **tolerance(dtype))
    base = index == -1
    shrunk, added = served[0], served[1]
    assert not shrunk[base].any() and bool((added[base] == 1).all())  # no adapter term: the base layer's output
    vllms = run_ops(VLLM, x, lora_a, lora_b, index, dtype)[1]
    assert (vllms[base] - 1).abs().max() > 1  # vLLM's own op adds the last slot's adapter: the test can fail


def test_one_matmul_per_adapter_of_the_batch():
    weights = torch.arange(24.0).reshape(3, 1, 2, 4)
    inputs = torch.ones(4, 4)
    products = adapter_products(inputs, weights, torch.tensor([2, 0, -1, 2]), torch.float32)
    assert torch.equal(products[0], weights[2, 0].sum(1)) and torch.equal(products[3], products[0])
    assert torch.equal(products[1], weights[0, 0].sum(1)) and not products[2].any()
    assert adapter_products(inputs[:0], weights, torch.tensor([], dtype=torch.long), torch.float32).shape == (0, 2)
