"""Precision settings that need no model: the warning for bf16 on a CPU without native bf16 (the fp32 residual
stream, on a real model in the trainer and the engine: tests/e2e/test_precision.py)."""

from __future__ import annotations

import torch


def test_bf16_on_a_cpu_without_native_bf16_is_warned_of(monkeypatch):
    from rl_tpu.models.precision import slow_bf16_warning

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    assert "without native bf16" in slow_bf16_warning("bfloat16")
    assert slow_bf16_warning("float32") is None
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    assert slow_bf16_warning("bfloat16") is None
