"""The one-matmul CPU LoRA ops give what vLLM's per-token ops give, for a shared adapter and for mixed ones."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.sampler.cpu_lora import one_matmul_ops, shared_adapter

lora_ops = pytest.importorskip("vllm.lora.ops.torch_ops.lora_ops")
VLLM = {name: getattr(lora_ops, name) for name in ("bgmv_shrink", "bgmv_expand", "bgmv_expand_slice")}
FAST = one_matmul_ops(VLLM)


@pytest.mark.parametrize("indices", [[1] * 7, [-1] * 7, [0, 1, 1, 0, 2, 1, 0]], ids=["shared", "none", "mixed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_ops_equal_vllms(indices, dtype):
    generator = torch.Generator().manual_seed(0)
    tokens, hidden, rank, out = len(indices), 64, 8, 96
    x = torch.randn(tokens, hidden, generator=generator, dtype=dtype)
    lora_a = torch.randn(3, 1, rank, hidden, generator=generator, dtype=dtype)
    lora_b = torch.randn(3, 1, out, rank, generator=generator, dtype=dtype)
    index = torch.tensor(indices)
    # fp32: outputs reach 50, so sums that cancel near 0 keep ~2e-6 of rounding that depends on the CPU's kernels
    tolerance = {"rtol": 1e-5, "atol": 5e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}

    shrunk = {}
    for name, ops in (("vllm", VLLM), ("fast", FAST)):
        shrunk[name] = torch.zeros(tokens, rank, dtype=torch.float32)
        ops["bgmv_shrink"](x, lora_a, shrunk[name], index, 0.5)
    torch.testing.assert_close(shrunk["fast"], shrunk["vllm"], **tolerance)
    for add in (True, False):
        expanded, sliced = {}, {}
        for name, ops in (("vllm", VLLM), ("fast", FAST)):
            expanded[name] = torch.ones(tokens, out, dtype=dtype)
            ops["bgmv_expand"](shrunk["vllm"], lora_b, expanded[name], index, add)
            sliced[name] = torch.ones(tokens, out + 32, dtype=dtype)
            ops["bgmv_expand_slice"](shrunk["vllm"], lora_b, sliced[name], index, 16, out, add)
        torch.testing.assert_close(expanded["fast"], expanded["vllm"], **tolerance)
        torch.testing.assert_close(sliced["fast"], sliced["vllm"], **tolerance)


def test_only_a_shared_adapter_takes_the_fast_path():
    weights = torch.arange(24.0).reshape(3, 1, 2, 4)
    assert torch.equal(shared_adapter(weights, torch.tensor([2, 2, 2]), torch.float32), weights[2, 0])
    assert shared_adapter(weights, torch.tensor([2, 1, 2]), torch.float32) is None
    assert shared_adapter(weights, torch.tensor([], dtype=torch.long), torch.float32) is None
