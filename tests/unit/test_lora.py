"""LoRA's own logic on one process: the settings, the base checksum of trainer and engine, the adapter checks the
engine makes, merged weights, the reference as the base (the end-to-end runs are in tests/e2e/test_lora_e2e.py)."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.config import RunConfig
from rl_tpu.config.lora import LoraConfig
from rl_tpu.models.hf import stored_weights
from rl_tpu.records import WeightBundle, WeightSyncError
from rl_tpu.sync.bundle import check_adapter, check_kind, named_checksum
from rl_tpu.trainer import lora, weights

LORA = LoraConfig(lora_rank=8, lora_alpha=16)


@pytest.mark.parametrize(
    ("settings", "message"),
    [
        ({"lora_rank": 1000}, "lora_rank=1000 must be in [0, 512]"),
        ({"lora_rank": 8, "lora_alpha": 0}, "lora_alpha=0 must be > 0"),
        ({"lora_rank": 8, "sync": "delta"}, "allowed values are auto, adapter, merged"),
        ({"lora_rank": 8, "target_modules": []}, "all-linear or a non-empty list"),
    ],
)
def test_bad_settings_are_refused_naming_the_key(settings, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        LoraConfig(**settings)


def test_the_engine_rank_is_one_vllm_accepts_and_auto_sends_the_adapter_except_on_tpu():
    assert [LoraConfig(lora_rank=r).engine_max_rank for r in (1, 4, 8, 12, 300)] == [1, 8, 8, 16, 320]
    cfg = RunConfig()
    assert cfg.lora_sync is None  # lora_rank 0: full fine-tuning
    cfg.actor.lora = LoraConfig(lora_rank=8)
    assert cfg.lora_sync == "adapter"
    cfg.sync.transport = "tpu_sync"
    assert cfg.lora_sync == "merged"


def policy(model_dir, base_dtype=torch.float32, seed=0):
    """The tiny model with adapters, as the trainer builds it (unsharded), lora_B made non-zero."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    config = lora.add_adapters(model, LORA, base_dtype)
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.05)
    return model, config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_trainer_and_engine_compute_the_same_base_checksum_and_a_changed_base_is_refused(tiny_model_dir, dtype):
    model, config = policy(tiny_model_dir, dtype)
    assert {p.dtype for p in model.parameters() if not p.requires_grad} == {dtype}  # the base in the served dtype
    assert {p.dtype for p in model.parameters() if p.requires_grad} == {torch.float32}
    trainer = weights.base_checksum(model, dtype, rank=0)
    engine = named_checksum(stored_weights(tiny_model_dir, dtype))
    assert trainer == engine
    names = list(weights.served_params(model, "adapter"))
    check_adapter(adapter_bundle(names, config, trainer), engine, ADAPTABLE, None)  # the same base: accepted
    with torch.no_grad():
        model.model.layers[0].mlp.down_proj.base_layer.weight[0, 0] += 1.0
    changed = weights.base_checksum(model, dtype, rank=0)
    assert changed != engine
    with pytest.raises(WeightSyncError, match=f"over base {changed[:16]}, the engine serves base {engine[:16]}"):
        check_adapter(adapter_bundle(names, config, changed), engine, ADAPTABLE, None)


ADAPTABLE = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}


def adapter_bundle(names: list[str], config: dict, base: str, version: int = 1) -> WeightBundle:
    from rl_tpu.records import Bucket, TensorSpec

    specs = tuple(TensorSpec(name, "float32", (8, 8)) for name in names)
    return WeightBundle(version, "object_store", (Bucket(specs, "", None, 0),), 0, config, base)


def test_the_engine_refuses_an_empty_partial_unservable_or_changed_adapter(tiny_model_dir):
    model, config = policy(tiny_model_dir)
    names = list(weights.served_params(model, "adapter"))
    assert names[0] == "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"  # PEFT's saved names
    assert len(names) == 2 * 7 * len(model.model.layers)  # A and B of every linear layer of every block
    modules = check_adapter(adapter_bundle(names, config, "base"), "base", ADAPTABLE, None)
    assert check_adapter(adapter_bundle(names, config, "base", 2), "base", ADAPTABLE, modules) == modules
    refused = {
        "empty": ([], ADAPTABLE, None),
        "without lora_B": ([n for n in names if "q_proj.lora_B" not in n], ADAPTABLE, None),
        "not adaptable by the engine": (names, ADAPTABLE - {"down_proj"}, None),
        "not in the first adapter": ([n for n in names if "layers.0." not in n], ADAPTABLE, modules),
    }
    for why, (subset, adaptable, first) in refused.items():
        with pytest.raises(WeightSyncError, match="does not fit the served model"):
            check_adapter(adapter_bundle(subset, config, "base"), "base", adaptable, first)
    with pytest.raises(WeightSyncError, match="is not a PEFT LoRA weight"):  # a full weight in an adapter bundle
        check_adapter(adapter_bundle(["model.norm.weight"], config, "base"), "base", ADAPTABLE, None)
    full = WeightBundle(2, "object_store", (), 0)
    with pytest.raises(WeightSyncError, match="holds full weights and the engine serves adapters on its base"):
        check_kind(full, serves_adapters=True)
    with pytest.raises(WeightSyncError, match="holds a LoRA adapter and the engine serves full weights"):
        check_kind(adapter_bundle(names, config, "base"), serves_adapters=False)


def test_merged_weights_serve_what_the_adapter_computes_and_the_reference_is_the_base(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model, _ = policy(tiny_model_dir)
    ids = torch.randint(0, 200, (2, 12))
    merged = {name: weights.gathered(served) for name, served in weights.served_params(model, "merged").items()}
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    base_logits = plain(ids).logits
    loaded = plain.load_state_dict(merged, strict=False)  # every served name is a Hugging Face weight
    assert loaded.missing_keys == ["lm_head.weight"] and not loaded.unexpected_keys  # the tied head, sent once
    with torch.no_grad():
        adapted = model(ids).logits
        torch.testing.assert_close(plain(ids).logits, adapted, rtol=1e-5, atol=1e-5)
        assert (adapted - base_logits).abs().max() > 1e-2  # the adapter changes the outputs: the test can fail
        with lora.adapters_off(model):
            torch.testing.assert_close(model(ids).logits, base_logits, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(model(ids).logits, adapted)  # on again after the reference's forward


def test_no_module_matched_is_refused_before_training(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    with pytest.raises(ValueError, match=r"actor.lora.target_modules=\['no_such_proj'\]: Target modules .* not found"):
        lora.add_adapters(model, LoraConfig(lora_rank=8, target_modules=["no_such_proj"]), torch.float32)


def test_a_checkpoint_resumes_only_over_its_own_base_and_kind(tmp_path):
    from rl_tpu.models.hf import LORA_BASE_FILE
    from rl_tpu.trainer.checkpoint import check_lora_base

    (tmp_path / LORA_BASE_FILE).write_text('{"base_checksum": "a1b2c3", "base_model": "/models/base"}')
    check_lora_base(tmp_path, "a1b2c3")  # the same base: resumed
    with pytest.raises(ValueError, match="trained over base a1b2c3 .*/models/base.*this run's base is ffffff"):
        check_lora_base(tmp_path, "ffffff")
    with pytest.raises(ValueError, match="holds a LoRA adapter and this run trains full weights"):
        check_lora_base(tmp_path, None)
    with pytest.raises(ValueError, match="holds full weights and this run trains a LoRA adapter"):
        check_lora_base(tmp_path / "full", "a1b2c3")


def test_with_dropout_the_old_and_reference_logprobs_are_one_value_per_token(tiny_model_dir):
    """`actor.lora.lora_dropout` > 0 makes a train-mode forward a draw; the logprobs of the policy that sampled the
    batch, and of the reference, are taken in eval mode (as the engine samples): two computations agree exactly,
    and a batch that carries them as the engine's logprobs shows no gap, even with one update a step."""
    import dataclasses

    from conftest import free_port, make_batch

    from rl_tpu.trainer.worker import TrainerWorker

    cfg = RunConfig()
    cfg.device, cfg.model.dtype, cfg.trainer.micro_batch_size = "cpu", "float32", 8
    cfg.trainer.share_prompts = cfg.trainer.skip_zero_advantage_rows = False
    cfg.actor.lora = LoraConfig(lora_rank=8, lora_alpha=16, lora_dropout=0.5)
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        with torch.no_grad():  # lora_B starts at 0, where dropout on the adapter's input changes nothing
            for name, param in worker.model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0, 0.05)
        batch, update = make_batch(), worker.update
        t = update._padded(batch)
        with torch.no_grad():
            drawn = [update._logprobs(worker.model, t, batch.temperature, False)[0] for _ in range(2)]
            assert (drawn[0] - drawn[1]).abs().max() > 1e-3  # train mode: dropout draws
            old = [update._sampling_policy_logprobs(t, batch.temperature) for _ in range(2)]
            torch.testing.assert_close(old[0], old[1], rtol=0, atol=0)
        assert worker.token_kl(batch) == worker.token_kl(batch)  # the KL in the reward: policy and reference
        engine = [row[: len(ids)].tolist() for row, ids in zip(old[0], batch.completion_ids)]
        metrics = worker.train_step(dataclasses.replace(batch, sampler_logprobs=engine))
        assert metrics["actor/logprob_diff_max"] < 1e-6 and metrics["actor/logprob_diff"] < 1e-7, metrics
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
