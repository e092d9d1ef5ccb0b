"""LoRA end to end through the CLI: PEFT adapters on the FSDP2 trainer (2 ranks and 1), each version sent as the
adapter alone and served by vLLM's LoRA support (or merged), checked against the trainer's logprobs to 1e-5 per
token; the exported adapter loaded by PEFT and by vLLM; an exact resume from a checkpoint that holds the adapter alone.
Merged syncs are the full-weight path with merged names (tests/unit/test_lora.py checks the names and values)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import run_cli
from test_e2e import assert_same_steps

from rl_tpu.outputs.metrics import read_metrics

# a large learning rate: every version's adapter moves the policy well past the 1e-5 that tells versions apart
LORA = ("actor.lora.lora_rank=8", "algorithm.lr=1e-2")


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("lora")
    run_cli(root / "run", root / "cache", "trainer.total_steps=3", *LORA)
    return root


def base_model_dir(run_dir):
    """The tiny preset in the run's cache: adapter_config.json names the base by its folder's name, never its path
    (the exported folder holds no local path at all)."""
    export = run_dir / "export"
    for file in export.iterdir():
        assert str(run_dir.parent) not in file.read_bytes().decode("utf-8", errors="replace"), file.name
    name = json.loads((export / "adapter_config.json").read_text())["base_model_name_or_path"]
    return run_dir.parent / "cache" / "models" / name


def full_bundle_bytes(model_dir) -> int:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return sum(p.nbytes for p in model.parameters())  # a tied head once


def test_each_version_is_the_adapter_alone_and_the_engine_serves_what_the_trainer_has(lora_run):
    from safetensors.torch import load_file

    run_dir = lora_run / "run"
    rows = read_metrics(run_dir / "metrics.jsonl")[1:]
    adapter = load_file(run_dir / "export" / "adapter_model.safetensors")
    adapter_bytes = sum(t.nbytes for t in adapter.values())  # fp32: the served dtype of this run
    assert len(adapter) == 2 * 7 * 4  # lora_A and lora_B of the 7 linear layers of each of the 4 blocks
    for step, row in enumerate(rows, start=1):
        assert row["sync/version"] == step and row["rollout/weight_version"] == step - 1
        assert row["sync/bytes"] == adapter_bytes
        # versions 1 and 2 served as base plus adapter: the engine's logprobs are the trainer's (base + adapter)
        assert row["actor/logprob_diff"] < 1e-5, "sampler and trainer disagree on the logprobs of the same tokens"
        assert row["sampler/adapters_loaded"] == 1.0  # max_staleness 0: the newest version only
    # the tiny model is narrow (hidden 256): rank 8 is 1/21 of it; at 0.5B the ratio is 1/250 (benchmarks/)
    assert rows[0]["sync/bytes"] * 20 < full_bundle_bytes(base_model_dir(run_dir))


def test_the_exported_adapter_loads_in_peft_with_the_trainers_final_weights(lora_run, tmp_path):
    """PEFT's model from the exported folder gives the logits of the base plus the adapter in the last checkpoint
    (the trainer's own state, read with DCP), and not the base's."""
    from peft import PeftModel
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from rl_tpu.config.lora import LoraConfig
    from rl_tpu.trainer import lora

    run_dir = lora_run / "run"
    checkpoint = run_dir / "checkpoints" / "step_3"
    assert json.loads((checkpoint / "lora_base.json").read_text())["base_checksum"]
    dcp_to_torch_save(checkpoint, tmp_path / "state.pt")
    state = torch.load(tmp_path / "state.pt", weights_only=True)["model"]
    assert state and all(lora.is_adapter_weight(name) for name in state)  # the checkpoint holds the adapter alone
    model_dir = base_model_dir(run_dir)
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora.add_adapters(trainer, LoraConfig(lora_rank=8), torch.float32)
    assert trainer.load_state_dict(state, strict=False).unexpected_keys == []
    exported = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), run_dir / "export"
    ).eval()
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    ids = torch.randint(0, 200, (2, 16))
    with torch.no_grad():
        logits = exported(ids).logits
        torch.testing.assert_close(logits, trainer.eval()(ids).logits, rtol=1e-5, atol=1e-5)
        assert (logits - base(ids).logits).abs().max() > 1e-3


VLLM_GREEDY = """
import json, sys
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
from vllm.lora.request import LoRARequest

base, adapter, rows = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
llm = LLM(base, dtype="float32", enforce_eager=True, max_model_len=128, kv_cache_memory_bytes=2**28,
          enable_chunked_prefill=False, enable_lora=True, max_lora_rank=8, max_loras=1)
params = SamplingParams(max_tokens=8, temperature=0.0, logprobs=0)
prompts = [TokensPrompt(prompt_token_ids=ids) for ids in rows]
served = LoRARequest("export", 1, adapter)
def greedy(outputs):
    return [[list(c.token_ids), [s[t].logprob for s, t in zip(c.logprobs, c.token_ids)]]
            for c in (o.outputs[0] for o in outputs)]
print("GREEDY", json.dumps(greedy(llm.generate(prompts, params, lora_request=served, use_tqdm=False))))
# rl_tpu's CPU ops (what its engines serve with), then each prompt with the adapter and without it in one batch
from rl_tpu.sampler.cpu_lora import use_one_matmul_per_adapter
use_one_matmul_per_adapter()
mixed = llm.generate(prompts * 2, params, lora_request=[served] * len(rows) + [None] * len(rows), use_tqdm=False)
print("MIXED", json.dumps(greedy(mixed)))
"""


def test_vllm_serves_the_exported_adapter_from_its_folder(lora_run):
    """vLLM's own loader (`LoRARequest` with the folder's path): the logprobs of its greedy tokens are PEFT's. Then,
    with rl_tpu's CPU LoRA ops, requests without the adapter beside requests with it get the base model's logprobs
    (vLLM's own CPU ops give them the adapter of the last slot: here the only one)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from rl_tpu.sampler.engine import SAMPLER_ENV

    run_dir = lora_run / "run"
    model_dir = base_model_dir(run_dir)
    rows = torch.randint(2, 200, (2, 12), generator=torch.Generator().manual_seed(0)).tolist()
    env = {**os.environ, **SAMPLER_ENV, "TORCHDYNAMO_DISABLE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", VLLM_GREEDY, model_dir, str(run_dir / "export"), json.dumps(rows)],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    served = json.loads(result.stdout.split("GREEDY ", 1)[1].split("\nMIXED ", 1)[0])
    mixed = json.loads(result.stdout.split("MIXED ", 1)[1])
    peft = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), run_dir / "export"
    )
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def logprobs_of(model, prompt: list[int], ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1 : -1].float()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)

    apart = 0.0
    for prompt, (ids, logprobs) in zip(rows, served):
        torch.testing.assert_close(torch.tensor(logprobs), logprobs_of(peft.eval(), prompt, ids), rtol=0, atol=1e-4)
        apart = max(apart, (torch.tensor(logprobs) - logprobs_of(base, prompt, ids)).abs().max().item())
    assert apart > 1e-3  # the base alone would not pass: the test can fail
    for prompt, (ids, logprobs), (base_ids, base_logprobs) in zip(rows, mixed[: len(rows)], mixed[len(rows) :]):
        torch.testing.assert_close(torch.tensor(logprobs), logprobs_of(peft, prompt, ids), rtol=0, atol=1e-4)
        torch.testing.assert_close(torch.tensor(base_logprobs), logprobs_of(base, prompt, base_ids), rtol=0, atol=1e-4)


def test_resume_from_a_lora_checkpoint_is_exact(lora_run, tmp_path):
    run_dir = tmp_path / "run"
    shutil.copytree(lora_run / "run", run_dir)
    shutil.rmtree(run_dir / "checkpoints" / "step_3")
    rows = read_metrics(run_dir / "metrics.jsonl")
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows if r["step"] <= 2))
    run_cli(run_dir, lora_run / "cache", "trainer.total_steps=3", "trainer.resume=auto", *LORA)
    resumed = read_metrics(run_dir / "metrics.jsonl")
    assert [r["step"] for r in resumed] == [0, 1, 2, 3]
    assert_same_steps(resumed[3:], lora_run / "run")


def test_async_engines_keep_the_staleness_window_and_stale_adapters_differ(lora_run, tmp_path):
    """max_staleness=1: rollouts of the previous version, served from its own adapter, which the engine keeps; the
    KL loss's reference is the base (the adapters bypassed), which the policy equals before its first update; the
    merged model exported beside the adapter."""
    run_cli(
        tmp_path / "run", lora_run / "cache", "trainer.total_steps=3", "trainer.max_staleness=1",
        "trainer.world_size=1", "actor.use_kl_loss=true", "actor.lora.export_merged=true", *LORA,
    )  # fmt: skip
    rows = read_metrics(tmp_path / "run" / "metrics.jsonl")[1:]
    assert [r["rollout/weight_version"] for r in rows] == [0, 0, 1]
    # fresh rollouts agree with the trainer; stale ones came from another version's adapter, which differs
    assert rows[0]["actor/logprob_diff"] < 1e-5 and all(r["actor/logprob_diff"] > 1e-5 for r in rows[1:])
    assert [r.get("sampler/adapters_loaded") for r in rows] == [None, 1.0, 2.0]  # async: step 1 reports none
    assert rows[0]["actor/kl"] == 0.0 and all(r["actor/kl"] > 0.0 for r in rows[1:])
    assert (tmp_path / "run" / "export_merged" / "model.safetensors").is_file()
    assert (tmp_path / "run" / "export" / "adapter_model.safetensors").is_file()
