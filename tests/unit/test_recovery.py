"""Checkpoint lifecycle, skipped non-finite updates, and the checks that run before Ray starts."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import compose_run

from rl_tpu.cluster.calls import ActorError
from rl_tpu.controller import checks
from rl_tpu.controller.checks import validate
from rl_tpu.controller.recovery import SkippedStepGuard, StopRequest, with_restarts
from rl_tpu.controller.run import check_inputs
from rl_tpu.data.datasets import Example
from rl_tpu.outputs import checkpoints
from rl_tpu.outputs.metrics import MetricsLogger, read_metrics


def make_checkpoint(run_dir, name: str, complete: bool = True):
    folder = run_dir / "checkpoints" / name
    folder.mkdir(parents=True)
    if complete:
        (folder / ".metadata").write_bytes(b"")
    return folder


def test_partial_and_incomplete_folders_are_never_resumed_from(tmp_path):
    make_checkpoint(tmp_path, "step_2")
    make_checkpoint(tmp_path, "step_4.partial")  # a save that crashed after writing its metadata
    make_checkpoint(tmp_path, "step_6", complete=False)
    assert checkpoints.latest(tmp_path).name == "step_2"
    with pytest.raises(FileNotFoundError, match="no complete checkpoint"):
        checkpoints.latest(tmp_path / "elsewhere")


def test_a_checkpoint_without_its_data_position_is_refused_naming_the_file(tmp_path):
    folder = make_checkpoint(tmp_path, "step_3")
    with pytest.raises(FileNotFoundError, match=f"{folder} has no data.json \\(the data position\\)"):
        checkpoints.data_position(folder)
    for name, text in checkpoints.driver_files(5, None).items():  # dynamic sampling took 5 batches in 3 steps
        (folder / name).write_text(text)
    assert checkpoints.data_position(folder) == 5 and not (folder / checkpoints.KL_COEF).exists()


def test_a_resume_refuses_settings_that_change_what_is_learned_unless_allowed(tmp_path):
    from omegaconf import OmegaConf

    from rl_tpu.config import RunConfig
    from rl_tpu.controller.checks import check_resumed_settings

    def settings(**changes) -> dict:
        cfg = RunConfig()
        for key, value in changes.items():
            section, name = key.split("__")
            setattr(getattr(cfg, section), name, value)
        return yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(cfg)))

    folder = make_checkpoint(tmp_path, "step_3")
    (folder / checkpoints.SETTINGS).write_text(yaml.safe_dump(settings()))
    changed = check_resumed_settings(folder, settings(trainer__total_steps=200, sync__transport="shm_file"), [])
    assert changed == {"trainer.total_steps": (100, 200), "sync.transport": ("object_store", "shm_file")}
    with pytest.raises(ValueError, match=r"model.dtype: 'float32' -> 'bfloat16', sampler.n: 8 -> 4\. .*"
                       r"trainer.resume_allow_changes=\[model.dtype,sampler.n\]"):  # fmt: skip
        check_resumed_settings(folder, settings(model__dtype="bfloat16", sampler__n=4), [])
    assert check_resumed_settings(folder, settings(sampler__n=4), ["sampler.n"]) == {"sampler.n": (8, 4)}
    (folder / checkpoints.SETTINGS).unlink()
    with pytest.raises(FileNotFoundError, match="has no config.yaml"):
        check_resumed_settings(folder, settings(), [])


def saved_run(folder, **changes) -> dict:
    """The settings of a default run with `changes` (section__key=value), as a checkpoint's config.yaml holds them."""
    from omegaconf import OmegaConf

    from rl_tpu.config import RunConfig

    cfg = RunConfig()
    for key, value in changes.items():
        *sections, name = key.split("__")
        section = cfg
        for part in sections:
            section = getattr(section, part)
        setattr(section, name, value)
    settings = yaml.safe_load(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
    (folder / checkpoints.SETTINGS).write_text(yaml.safe_dump(settings))
    return settings


@pytest.mark.parametrize("loss", ["clip_cov", "kl_cov", "geo_mean", "vanilla"])
def test_a_resume_keeps_the_micro_batches_under_the_losses_that_depend_on_them(tmp_path, loss):
    """clip_cov and kl_cov pick tokens by statistics of each micro-batch (test_algorithms.py checks which losses do):
    a resume that changes which rows share one changes their loss, and is refused naming the keys and the loss."""
    from rl_tpu.algorithms.registry import LOSS_FACTS
    from rl_tpu.controller.checks import check_resumed_settings

    folder = make_checkpoint(tmp_path, "step_3")
    saved_run(folder, actor__policy_loss__loss_mode=loss)
    resplit = dict(trainer__micro_batch_size=2, trainer__world_size=2, trainer__sort_by_length=False)
    now = saved_run(tmp_path, actor__policy_loss__loss_mode=loss, **resplit)
    if not LOSS_FACTS[loss].micro_batch_statistics:
        assert set(check_resumed_settings(folder, now, [])) == set(checks.MICRO_BATCH_KEYS)
        return
    with pytest.raises(ValueError, match=r"trainer.micro_batch_size: 64 -> 2, trainer.sort_by_length: True -> False, "
                       rf"trainer.world_size: 1 -> 2 \(under actor.policy_loss.loss_mode={loss} the loss picks its "
                       r"tokens by statistics of each micro-batch"):  # fmt: skip
        check_resumed_settings(folder, now, [])
    check_resumed_settings(folder, now, list(checks.MICRO_BATCH_KEYS))  # named: changed anyway, as any other key


def test_a_resume_in_the_same_folder_keeps_the_held_out_set(tmp_path):
    """The folder's held-out accuracies so far are on the checkpoint's set: a gain to another set means nothing.
    A new folder (trainer.resume_from) starts its held-out baseline afresh, on the new set."""
    from rl_tpu.controller.checks import check_resumed_settings

    folder = make_checkpoint(tmp_path, "step_3")
    saved_run(folder)
    for key, value in [("data__val_max_samples", 64), ("data__val_files", "other.parquet")]:
        now = saved_run(tmp_path, **{key: value})
        dotted = key.replace("__", ".")
        assert dotted in check_resumed_settings(folder, now, [])  # into a new folder
        with pytest.raises(ValueError, match=rf"in its own run folder with another held-out set \({dotted}: .*"
                           rf"trainer.resume_from={folder} with another hydra.run.dir"):  # fmt: skip
            check_resumed_settings(folder, now, [], continues_folder=True)
    now = saved_run(tmp_path, data__num_eval=64)  # the arithmetic task's held-out set, allowed by name
    with pytest.raises(ValueError, match=r"another held-out set \(data.num_eval: 512 -> 64\)"):
        check_resumed_settings(folder, now, ["data.num_eval"], continues_folder=True)
    now = saved_run(tmp_path, data__shuffle_seed=5)  # the training order only
    assert check_resumed_settings(folder, now, ["data.shuffle_seed"], continues_folder=True)


def test_every_file_a_resume_reads_is_checked_before_ray_starts(tmp_path):
    """The driver's files and the ranks' shards (whole, as the metadata lists them) of a checkpoint are read by the
    checks before Ray starts: one that is missing or cut short refuses the resume there, naming it."""
    import torch
    import torch.distributed.checkpoint as dcp

    folder = tmp_path / "checkpoints" / "step_2"
    dcp.save({"model": {"w": torch.arange(1000.0)}}, checkpoint_id=str(folder))
    for name, text in checkpoints.driver_files(2, 0.1).items():
        (folder / name).write_text(text)
    checks.check_resume_files(folder, kl_in_reward=True, replay_queued=True)
    (shard,) = folder.glob("*.distcp")
    shard.write_bytes(shard.read_bytes()[:-8])
    with pytest.raises(FileNotFoundError, match=f"its shard {shard.name} is missing or shorter than its metadata"):
        checks.check_resume_files(folder, kl_in_reward=False, replay_queued=False)
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=f"its shard {shard.name} is missing"):
        checks.check_resume_files(folder, kl_in_reward=False, replay_queued=False)
    for name, needed in [(checkpoints.QUEUED, "replay_queued"), (checkpoints.KL_COEF, "kl_in_reward")]:
        (folder / name).unlink()
        with pytest.raises(FileNotFoundError, match=f"has no {name}"):
            checks.check_resume_files(folder, **{"kl_in_reward": False, "replay_queued": False, needed: True})
    (folder / checkpoints.DATA_POSITION).unlink()
    with pytest.raises(FileNotFoundError, match="has no data.json"):
        checks.check_resume_files(folder, kl_in_reward=False, replay_queued=False)


def test_keep_last_keeps_exactly_the_newest_and_clears_interrupted_saves(tmp_path):
    for step in (2, 4, 6, 8):
        make_checkpoint(tmp_path, f"step_{step}")
    make_checkpoint(tmp_path, "step_9.partial")
    checkpoints.prune(tmp_path, keep_last=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_6", "step_8"]
    checkpoints.prune(tmp_path, keep_last=0)  # 0 keeps every complete one
    assert len(list((tmp_path / "checkpoints").iterdir())) == 2


def test_skipped_updates_are_counted_and_too_many_in_a_row_stop_the_run():
    guard = SkippedStepGuard(max_in_a_row=2)
    prompts = [Example([1, 2], "src", "3", {"index": 41}), Example([4], "src", "5", {"index": 7})]
    steps = [{"actor/skipped": 1.0}, {"actor/skipped": 0.0}, {"actor/skipped": 1.0}]
    for step, metrics in enumerate(steps, start=1):
        guard.observe(step, metrics, prompts)
    assert [m["actor/skipped_steps"] for m in steps] == [1.0, 1.0, 2.0]
    with pytest.raises(FloatingPointError, match=r"2 updates in a row .* step 4, prompts \[41, 7\]"):
        guard.observe(4, {"actor/skipped": 1.0}, prompts)


@pytest.mark.parametrize(
    "override, message",
    [
        ("trainer.eval_every=0", "trainer.eval_every=0"),
        ("trainer.micro_batch_size=0", "trainer.micro_batch_size=0"),
        ("actor.kl_loss_type=k9", "actor.kl_loss_type='k9': allowed values are kl, k1"),
        ("trainer.keep_last=-1", "trainer.keep_last=-1"),
        ("trainer.max_restarts=-1", "trainer.max_restarts=-1"),
        ("sampler.max_restarts=-2", "sampler.max_restarts=-2"),
        ("reward.worker_memory_mb=0", "reward.worker_memory_mb=0"),
        ("trainer.resume_from=/no/such/run", "trainer.resume_from=/no/such/run: no complete checkpoint"),
    ],
)
def test_settings_that_used_to_fail_late_fail_in_validation(override, message):
    with pytest.raises(Exception, match=message):
        validate(compose_run(override))


def test_a_batch_larger_than_the_data_and_a_model_without_decoder_blocks_are_refused(tiny_model_dir, tmp_path):
    cfg = compose_run("data.train_batch_size=4")
    few = [Example([1], "src", "1", {})] * 3
    with pytest.raises(ValueError, match="data.train_batch_size=4 is larger than the 3 usable prompts"):
        check_inputs(cfg, tiny_model_dir, few)
    check_inputs(cfg, tiny_model_dir, few * 2)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(
        json.dumps(
            {
                "model_type": "gpt2",
                "n_layer": 1,
                "n_embd": 8,
                "n_head": 2,
                "vocab_size": 16,
                "architectures": ["GPT2LMHeadModel"],
            }
        )
    )
    with pytest.raises(TypeError, match="model_type 'gpt2' has no family record"):
        check_inputs(cfg, gpt2, few * 2)


def test_the_resume_point_prefers_this_run_folder_then_resume_from(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    make_checkpoint(there, "step_4")
    assert checkpoints.resume_point(here, this_run=True, resume_from=None) is None  # auto, nothing yet: from the start
    assert checkpoints.resume_point(here, this_run=True, resume_from=str(there)).name == "step_4"
    make_checkpoint(here, "step_6")
    assert checkpoints.resume_point(here, this_run=True, resume_from=str(there)) == here / "checkpoints" / "step_6"
    assert checkpoints.resume_point(here, this_run=False, resume_from=str(there)).name == "step_4"
    assert [checkpoints.every(None, n) for n in (3, 100, 450)] == [1, 10, 45]
    assert checkpoints.every(0, 100) == 0 and checkpoints.every(7, 100) == 7


def test_a_resumed_run_continues_its_metrics_file(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=6, show_progress=False)
    for step in range(5):
        logger.log(step, {"eval/accuracy": step / 10} if step % 2 == 0 else {"reward/mean": 1.0})
    logger.close()
    resumed = MetricsLogger(tmp_path, total_steps=6)
    resumed.truncate_after(2)  # the checkpoint was at step 2: steps 3-4 run again
    assert resumed.bar.n == 2  # the progress bar starts at the resumed step
    resumed.log(3, {"reward/mean": 0.5})
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [0, 1, 2, 3]
    assert resumed.evals() == [0.0, 0.2] and resumed.bar.n == 3
    resumed.truncate_after(None)  # a run starting over in this folder
    assert read_metrics(tmp_path / "metrics.jsonl") == [] and resumed.evals() == []


def test_only_a_lost_actor_restarts_the_run_and_only_so_often():
    attempts = []

    def attempt(restarts: int, error: ActorError):
        attempts.append(restarts)
        if len(attempts) <= 2:
            raise error
        return "done"

    assert with_restarts(lambda n: attempt(n, ActorError("trainer_1 died", "trainer_1", lost=True)), 2) == "done"
    assert attempts == [0, 1, 2]
    attempts.clear()
    with pytest.raises(ActorError, match="trainer_1 died"):  # restarts spent
        with_restarts(lambda n: attempt(n, ActorError("trainer_1 died", "trainer_1", lost=True)), 1)
    attempts.clear()
    with pytest.raises(ActorError, match="raised"):  # an exception would happen again: no restart
        with_restarts(lambda n: attempt(n, ActorError("train step failed: raised", "trainer_0")), 5)
    assert attempts == [0]


def test_a_signal_is_recorded_and_a_second_one_stops_at_once():
    import os
    import signal

    with StopRequest() as stop:
        os.kill(os.getpid(), signal.SIGTERM)
        assert stop.requested == "SIGTERM"
        with pytest.raises(KeyboardInterrupt, match="second SIGINT"):
            os.kill(os.getpid(), signal.SIGINT)
    assert signal.getsignal(signal.SIGTERM) is not stop._handle  # the previous handlers are back


def test_a_model_whose_norms_fp32_residual_cannot_replace_is_refused_before_ray(tmp_path):
    from transformers import GemmaConfig

    gemma = tmp_path / "gemma"
    GemmaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=4,
    ).save_pretrained(gemma)
    few = [Example([1], "src", "1", {})] * 8
    with pytest.raises(TypeError, match=r"GemmaRMSNorm at .input_layernorm.*set model.fp32_residual=false"):
        check_inputs(compose_run("data.train_batch_size=4", "model.dtype=bfloat16"), gemma, few)
    check_inputs(
        compose_run("data.train_batch_size=4", "model.dtype=bfloat16", "model.fp32_residual=false"), gemma, few
    )
    check_inputs(compose_run("data.train_batch_size=4"), gemma, few)  # fp32: nothing to replace


def test_a_full_disk_is_named_before_a_save_and_a_failed_save_leaves_nothing(tmp_path, monkeypatch):
    import shutil
    from collections import namedtuple

    import torch

    from rl_tpu.trainer import checkpoint as trainer_checkpoint

    usage = namedtuple("usage", "total used free")
    folder = make_checkpoint(tmp_path, "step_2")
    (folder / "__0_0.distcp").write_bytes(b"x" * 3 * 2**20)  # the last checkpoint took 3 MiB
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30 - 2**20, 2**20))
    with pytest.raises(OSError, match=r"no room for the next checkpoint .*: 1 MiB free .*step_2 took 3 MiB"):
        checkpoints.check_room(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 0, 2**30))
    checkpoints.check_room(tmp_path)  # room enough: nothing said

    def save_until_the_disk_fills(state, checkpoint_id):
        Path(checkpoint_id).mkdir(parents=True)
        (Path(checkpoint_id) / "__0_0.distcp").write_bytes(b"half")
        raise RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598")

    monkeypatch.setattr(trainer_checkpoint.dcp, "save", save_until_the_disk_fills)
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(2**30, 2**30, 0))
    model = torch.nn.Linear(2, 2)
    optimizer = torch.optim.AdamW(model.parameters())
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0)
    target = tmp_path / "checkpoints" / "step_4"
    with pytest.raises(OSError, match=r"saving .*step_4 failed \(no space left on its filesystem: 0 MiB free"):
        trainer_checkpoint.save_checkpoint(str(target), model, optimizer, schedule, str(tmp_path), rank=0)
    assert not target.with_name("step_4.partial").exists()  # the resume command works: nothing to trip over
    assert checkpoints.latest(tmp_path).name == "step_2"
