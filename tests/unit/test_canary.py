"""The weight canary's logic without an engine (rl_tpu/sync/canary.py): the gap against the dtype's bound or
`sync.canary.max_gap`, a still canary while the trainer's moved, each failure naming the engine, the version, the
gap and the key; the canary's sequences, and both sides reading the same tokens' logprobs in the same order."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from rl_tpu.config import CanaryConfig
from rl_tpu.records import Canary, CanaryTokens
from rl_tpu.sampler.scoring import continuation_logprobs
from rl_tpu.sync.canary import BOUNDS, CANARY_TOKENS, CanaryError, CanaryWatch, bound, canary_tokens
from rl_tpu.trainer.canary import score_canary

NAMES = ["sampler_0", "sampler_1"]
TRAINER_V0 = (-1.0, -2.0, -0.5, -3.0)


def canary(version: int, logprobs=TRAINER_V0, dtype: str = "float32") -> Canary:
    return Canary(version, dtype, tuple(logprobs))


def shifted(logprobs, by: float) -> list[float]:
    return [lp + by for lp in logprobs]


def test_an_engine_within_the_bound_passes_with_its_gaps_as_metrics():
    watch = CanaryWatch()
    figures = watch.check(canary(0), [shifted(TRAINER_V0, 1e-6), list(TRAINER_V0)], NAMES)
    assert figures == {"sync/canary_gap": pytest.approx(1e-6), "sync/canary_gap_mean": pytest.approx(1e-6)}
    moved = canary(1, shifted(TRAINER_V0, 0.05))
    figures = watch.check(moved, [shifted(moved.logprobs, 2e-6), shifted(moved.logprobs, -3e-6)], NAMES)
    assert figures["sync/canary_gap"] == pytest.approx(3e-6) and figures["sync/canary_moved"] == pytest.approx(0.05)


def test_a_gap_past_the_dtype_bound_names_the_engine_version_gap_and_key():
    watch = CanaryWatch()
    watch.check(canary(0), [list(TRAINER_V0)] * 2, NAMES)
    stale = [list(TRAINER_V0), list(TRAINER_V0)]  # both engines still answer as v0
    with pytest.raises(CanaryError) as err:
        watch.check(canary(1, shifted(TRAINER_V0, 0.01)), [shifted(TRAINER_V0, 0.01), stale[1]], NAMES)
    message = str(err.value)
    assert "sampler_1 failed the weight canary after installing v1" in message
    assert "a gap of 0.01 (mean 0.01) to trainer rank 0's logprobs on 4 tokens, past" in message
    assert "sync.canary.max_gap=0.0002 (the float32 default)" in message


def test_the_bound_is_set_by_dtype_or_by_the_key():
    assert bound("float32", None) == (BOUNDS["float32"], "sync.canary.max_gap=0.0002 (the float32 default)")
    assert bound("bfloat16", None)[0] == BOUNDS["bfloat16"] > 100 * BOUNDS["float32"]
    assert bound("bfloat16", 0.02) == (0.02, "sync.canary.max_gap=0.02")
    with pytest.raises(ValueError, match="model.dtype=float16: set sync.canary.max_gap"):
        bound("float16", None)
    bf16_gap = [lp + 0.3 for lp in TRAINER_V0]  # within bf16's bound (0.28 measured), past fp32's
    CanaryWatch().check(canary(0, dtype="bfloat16"), [bf16_gap] * 2, NAMES)
    with pytest.raises(CanaryError, match=r"past sync.canary.max_gap=0.1\. "):
        CanaryWatch(max_gap=0.1).check(canary(0, dtype="bfloat16"), [bf16_gap] * 2, NAMES)
    with pytest.raises(ValueError, match="sync.canary.max_gap=0 must be > 0"):
        CanaryConfig(max_gap=0)


def test_the_version_0_canary_names_the_first_evaluation_and_a_nan_or_missing_answer_fails():
    with pytest.raises(CanaryError, match="sampler_0 failed the weight canary at start, before the first evaluation"):
        CanaryWatch().check(canary(0), [shifted(TRAINER_V0, 0.5), list(TRAINER_V0)], NAMES)
    with pytest.raises(CanaryError, match="a gap of nan"):
        CanaryWatch().check(canary(0), [list(TRAINER_V0), [float("nan"), -2.0, -0.5, -3.0]], NAMES)
    with pytest.raises(CanaryError, match="sampler_1 returned no canary after installing v3"):
        CanaryWatch().check(canary(3), [list(TRAINER_V0), None], NAMES)
    with pytest.raises(CanaryError, match="the engine scored 3 canary tokens, the trainer 4"):
        CanaryWatch().check(canary(0), [[-1.0, -2.0, -0.5], list(TRAINER_V0)], NAMES)


def test_a_still_canary_is_caught_where_the_update_moved_the_trainer_less_than_the_bound():
    """bf16: one update moves the canary about as much as rounding does, so the gap alone cannot see a stale engine;
    a stale engine's answer is bit for bit its last one while the trainer's moved."""
    noisy_v0 = shifted(TRAINER_V0, 0.2)  # bf16 rounding: a large gap, under the bound
    watch = CanaryWatch()
    watch.check(canary(0, dtype="bfloat16"), [noisy_v0, list(TRAINER_V0)], NAMES)
    v1 = canary(1, shifted(TRAINER_V0, 0.08), dtype="bfloat16")  # as one update of grpo_math moves it at least
    with pytest.raises(CanaryError) as err:
        watch.check(v1, [shifted(v1.logprobs, 0.01), list(TRAINER_V0)], NAMES)
    message = str(err.value)
    assert (
        "sampler_1 failed the weight canary after installing v1: its canary is bit for bit the one it gave for v0"
        in (message)
    )
    assert "moved by up to 0.08; a gap of 0.08" in message
    assert "under sync.canary.max_gap=1 (the bfloat16 default). It still serves v0" in message
    # a move within rounding's reach (under a twentieth of the bound) may leave a correct engine's answer unchanged
    watch = CanaryWatch()
    watch.check(canary(0, dtype="bfloat16"), [noisy_v0, list(TRAINER_V0)], NAMES)
    v1 = canary(1, shifted(TRAINER_V0, 0.04), dtype="bfloat16")
    assert watch.check(v1, [noisy_v0, list(TRAINER_V0)], NAMES)["sync/canary_moved"] == pytest.approx(0.04)


def test_an_engine_brought_back_or_checked_first_at_a_later_version_is_compared_by_gap_alone():
    watch = CanaryWatch()
    watch.check(canary(0), [list(TRAINER_V0)] * 2, NAMES)
    watch.engines.pop(1)  # restarted: its last answer is gone
    v1 = canary(1, shifted(TRAINER_V0, 1e-4))
    figures = watch.check(v1, [list(v1.logprobs), list(TRAINER_V0)], NAMES)  # under the bound: no version to compare
    assert figures["sync/canary_gap"] == pytest.approx(1e-4)


class WordTokenizer:
    """One id per character: enough for the canary's sequences."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        assert not add_special_tokens  # a BOS would differ between tokenizers that add one and the engine
        return {"input_ids": [ord(c) % 500 for c in text]}


def test_the_canary_is_four_sequences_of_16_tokens_with_short_prompts():
    tokens = canary_tokens(WordTokenizer())
    assert len(tokens.sequences) == 4 and {len(s) for s in tokens.sequences} == {CANARY_TOKENS}
    assert all(1 <= start <= 6 for start in tokens.starts)
    assert tokens.sequences[0][: tokens.starts[0]] == tuple(ord(c) for c in "Q: Wha")  # the prompt, cut to 6 tokens


def test_both_sides_score_the_continuation_tokens_in_the_same_order():
    """The trainer's batched, right-padded forward equals each sequence alone at each continuation token, and the
    engine's prompt logprobs are read at the same positions (position p: token p given the ones before)."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
    )
    model = Qwen3ForCausalLM(config).train()
    tokens = CanaryTokens(((3, 9, 4, 20, 7), (11, 2, 30)), (2, 1))  # unequal lengths: the second is padded
    scored = score_canary(model, tokens, 4, "float32", torch.device("cpu"))
    assert model.training  # given back in the mode it was in
    expected = []
    with torch.no_grad():
        for sequence, start in zip(tokens.sequences, tokens.starts):
            rows = model.eval()(input_ids=torch.tensor([sequence])).logits[0].log_softmax(-1)
            expected += [rows[p - 1, sequence[p]].item() for p in range(start, len(sequence))]
    assert scored.version == 4 and scored.logprobs == pytest.approx(expected, abs=1e-5)

    def prompt_logprobs(sequence, values):
        return [None] + [{token: SimpleNamespace(logprob=v)} for token, v in zip(sequence[1:], values)]

    outputs = [
        SimpleNamespace(prompt_logprobs=prompt_logprobs(s, [float(10 * i + p) for p in range(1, len(s))]))
        for i, s in enumerate(tokens.sequences)
    ]
    assert continuation_logprobs(outputs, tokens) == [2.0, 3.0, 4.0, 11.0, 12.0]
