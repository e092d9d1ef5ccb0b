"""Weight sync into a running vLLM engine: exact, versioned, checksummed, and parity with the trainer."""

from __future__ import annotations

import dataclasses
import shutil

import pytest
import torch

from rl_tpu import sync
from rl_tpu.sampler import SamplingSettings, launch_sampler
from rl_tpu.trainer import pad_batch, token_logprobs
from rl_tpu.rollout import TrainBatch

PROMPTS = ["Q: What is 12 + 7? A:", "Q: What is 3 - 50? A:", "Q: What is 99 + 99? A:", "Q: What is 0 - 0? A:"]
GREEDY = SamplingSettings(n=1, temperature=0.0, max_tokens=12)


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir, tmp_path_factory):
    """A differently initialised model of the same shape, saved as its own Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir)).float()
    folder = tmp_path_factory.mktemp("new") / "model"
    shutil.copytree(tiny_model_dir, folder)
    model.save_pretrained(folder)
    return model.eval(), folder


def _prompt_ids(folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def _generate(ray, sampler, prompts, settings=GREEDY):
    return ray.get(sampler.generate.remote(prompts, settings))


def test_sync_makes_engine_equal_a_fresh_engine_and_enforces_the_contract(ray_cluster, tiny_model_dir, new_weights):
    ray = ray_cluster
    model, folder = new_weights
    prompts = _prompt_ids(folder)
    running = launch_sampler(str(tiny_model_dir), "float32", 128, 0.25, seed=0)
    fresh = launch_sampler(str(folder), "float32", 128, 0.25, seed=0)
    before = _generate(ray, running, prompts)

    bundle = sync.pack({k: v.detach().clone() for k, v in model.state_dict().items()}, version=1)
    ray.get(running.install.remote(bundle))
    assert ray.get(running.serving_version.remote()) == 1
    synced, expected = _generate(ray, running, prompts), _generate(ray, fresh, prompts)
    assert [r.completion_ids for r in synced] == [r.completion_ids for r in expected]
    assert [r.logprobs for r in synced] == [r.logprobs for r in expected]
    assert [r.completion_ids for r in synced] != [r.completion_ids for r in before]  # the weights really changed
    assert {r.weight_version for r in synced} == {1}

    # A stale version is refused; the engine keeps serving v1.
    with pytest.raises(Exception, match="refusing older or equal bundle v1"):
        ray.get(running.install.remote(bundle))
    # A corrupted payload (the checksum no longer matches) is detected before anything is installed.
    other = sync.pack({k: torch.zeros_like(v) for k, v in model.state_dict().items()}, version=2)
    tampered = dataclasses.replace(other, checksum=sync.pack(model.state_dict(), version=2).checksum)
    with pytest.raises(Exception, match="checksum mismatch"):
        ray.get(running.install.remote(tampered))
    assert ray.get(running.serving_version.remote()) == 1
    assert [r.completion_ids for r in _generate(ray, running, prompts)] == [r.completion_ids for r in expected]

    # Sampler logprobs (processed, after temperature) match a trainer-style fp32 forward of the same tokens.
    sampled = _generate(ray, running, prompts, SamplingSettings(n=4, temperature=0.7, max_tokens=12))
    batch = TrainBatch([r.prompt_ids for r in sampled], [r.completion_ids for r in sampled],
                       [r.logprobs for r in sampled], [0.0] * len(sampled), 0.7)
    t = pad_batch(batch, pad_id=1, device=torch.device("cpu"))
    with torch.no_grad():
        log_prob, _ = token_logprobs(model, t, 0.7, with_entropy=False)
    mask = t["response_mask"]
    mean_abs = ((log_prob - t["sampler_logprobs"]).abs() * mask).sum() / mask.sum()
    assert mask.sum() > 20 and mean_abs < 1e-5, f"mean |sampler - trainer| logprob = {mean_abs:.2e}"
    for handle in (running, fresh):
        ray.get(handle.shutdown.remote())


def test_pack_unpack_is_bit_exact_for_any_dtype(ray_cluster):
    state = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(4)}
    tensors, _ = sync.unpack(sync.pack(state, version=3))
    assert [n for n, _ in tensors] == list(state)
    for name, tensor in tensors:
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name])
