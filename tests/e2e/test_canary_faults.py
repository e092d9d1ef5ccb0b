"""The weight canary (rl_tpu/sync/canary.py) with real vLLM engines and FSDP2 trainer actors, started as a run starts
them: a correct sync passes, and each way an engine can serve other weights than the trainer published is caught
within one step, naming the engine and the version. Faults are injected inside the actors (a patched attribute of
the engine's or the trainer's own objects, `__ray_call__`), never by mocking vLLM; one set of actors serves the
full-weight faults (fp32, the tiny recipe's dtype: the gap catches them) and one the LoRA fault (bf16, where one
update moves the canary less than rounding does: an engine whose canary did not move while the trainer's did is
caught)."""

from __future__ import annotations

import pytest
import ray
import torch
from conftest import make_batch, ship_by_value

from rl_tpu.config import RunConfig
from rl_tpu.controller.actors import ActorHandles, start_actors
from rl_tpu.models.shipped import SHIPPED, read_manifest
from rl_tpu.sync.canary import BOUNDS, CanaryError

TIMEOUT_S = 600


def run_config(lora_rank: int = 0) -> RunConfig:
    """The tiny recipe's step (grpo_math: lr 3e-5; grpo_math_lora: rank 8, lr 5e-4, here in bf16) on one rank and
    one engine."""
    cfg = RunConfig()
    cfg.device, cfg.algorithm.lr, cfg.sampler.kv_cache_gb = "cpu", 3e-5, 0.25
    if lora_rank:
        cfg.actor.lora.lora_rank, cfg.algorithm.lr, cfg.model.dtype = lora_rank, 5e-4, "bfloat16"
    return cfg


# the tiny recipe's own model, warm-started, as the package ships it: the canary's figures are a real run's
RECIPE_MODEL = SHIPPED / next(key for key, entry in read_manifest().items() if entry["name"] == "grpo_math")


def started(cfg: RunConfig, tmp_path_factory):
    ship_by_value(__name__)  # the patches below run inside the actors
    actors = start_actors(cfg, RECIPE_MODEL, tmp_path_factory.mktemp("canary_run"), "cpu")
    try:
        yield actors
    finally:
        actors.shutdown()


@pytest.fixture(scope="module")
def full(ray_cluster, tmp_path_factory):
    yield from started(run_config(), tmp_path_factory)


@pytest.fixture(scope="module")
def lora(ray_cluster, tmp_path_factory):
    yield from started(run_config(lora_rank=8), tmp_path_factory)


def in_actor(handle, function, *args):
    """`function(the actor's instance, *args)`, run inside the actor."""
    return ray.get(handle.__ray_call__.remote(function, *args), timeout=TIMEOUT_S)


def step(actors: ActorHandles, seed: int, wait: bool = True) -> dict[str, float]:
    """One update, its weights published as the next version and installed: the install's figures, and its
    canary's once checked (as a run checks it once the next batch is sent; async: the install before's)."""
    actors.train(make_batch(seed))
    return {**actors.install(actors.publish(actors.samplers.version + 1), wait=wait), **actors.samplers.settle_canary()}


# --- faults, each run inside the engine's or the trainer's process


def keep_old_weights(sampler, on: bool) -> None:
    """An install that verifies the bundle and reports the new version, and loads nothing."""
    if on:
        sampler.served.install = lambda bundle, tensors: None
    else:
        del sampler.served.install


def forget_tied_head(sampler, on: bool) -> None:
    """rl_tpu's handling of vLLM CPU's packed head removed: the head is no longer loaded under its own name."""
    sampler.saved_aliases = sampler.served.aliases if on else sampler.saved_aliases
    sampler.served.aliases = {} if on else sampler.saved_aliases


def embedding_only_update(worker, batch) -> None:
    """A real update whose change is kept on the (tied) embedding alone: every other weight is put back."""
    before = {n: p.detach().clone() for n, p in worker.model.named_parameters() if "embed_tokens" not in n}
    worker.train_step(batch)
    with torch.no_grad():
        for name, param in worker.model.named_parameters():
            if name in before:
                param.copy_(before[name])


def sleep_without_reload(sampler, on: bool) -> None:
    """Sleep mode emulated on CPU (vLLM's CPU engine has none): going to sleep (`fall_asleep`) keeps a host copy of
    the weights, as level 1 does, and the wake-up lands after the next install's load and copies them back over it."""
    if not on:
        del sampler.served.install
        return
    real, sampler.held = sampler.served.install, {}

    def install(bundle, tensors) -> None:
        real(bundle, tensors)
        if "asleep" in sampler.held:  # woken now: the weights it went to sleep with come back
            real(*sampler.held.pop("asleep"))
        sampler.held["last"] = (bundle, [(name, tensor.clone()) for name, tensor in tensors])

    sampler.served.install = install


def fall_asleep(sampler) -> None:
    sampler.held["asleep"] = sampler.held["last"]


def adapter_not_applied(sampler, on: bool) -> None:
    """The adapter loaded into vLLM (it lists it), and every request still sent to the base model."""
    if not on:
        del sampler.served.install
        return
    real = sampler.served.install

    def install(bundle, tensors) -> None:
        real(bundle, tensors)
        sampler.served.request = None

    sampler.served.install = install


def adapters_loaded(sampler) -> int:
    return len(sampler.served.versions)


def test_a_correct_sync_passes_and_one_update_moves_the_canary_past_the_fp32_bound(full):
    start = full.start_canary()  # what a run checks before its first evaluation
    assert start["sync/canary_gap"] < BOUNDS["float32"] / 4 and "sync/canary_moved" not in start
    figures = step(full, seed=0)
    assert figures["version"] == 1 and figures["sync/canary_gap"] < BOUNDS["float32"] / 4
    assert "canary" not in figures and figures["time/canary_s"] > 0  # the engine's answer is checked, not logged
    # the detection margin: a stale engine's gap would be what one update moved, well past the bound
    assert figures["sync/canary_moved"] > 3 * BOUNDS["float32"]


def test_an_evaluation_before_the_first_sync_is_stopped_by_the_version_0_canary(full):
    """The trainer's weights are not the engine's at start (here: one update the engine never received)."""
    full.train(make_batch(1))
    with pytest.raises(CanaryError, match="sampler_0 failed the weight canary at start, before the first evaluation"):
        full.start_canary()
    assert step(full, seed=2)["sync/canary_gap"] < BOUNDS["float32"]  # in sync again


def test_an_install_that_keeps_the_old_weights_is_caught_async(full):
    engine = full.samplers.engines[0]
    in_actor(engine, keep_old_weights, True)
    try:
        version = full.samplers.version + 1
        assert step(full, seed=3, wait=False) == {}  # async: the install is sent, its figures come at the next step
        full.samplers.finish_install()  # the engines' answers, held until the trainer's score is waited for
        with pytest.raises(CanaryError, match=rf"sampler_0 failed the weight canary after installing v{version}: "):
            full.samplers.settle_canary()
    finally:
        in_actor(engine, keep_old_weights, False)


def test_a_tied_head_left_stale_after_an_embedding_only_update_is_caught(full):
    engine = full.samplers.engines[0]
    in_actor(full.trainers[0], embedding_only_update, make_batch(4))  # with rl_tpu's handling: served
    full.install(full.publish(full.samplers.version + 1))
    assert full.samplers.settle_canary()["sync/canary_gap"] < BOUNDS["float32"]
    in_actor(engine, forget_tied_head, True)
    try:
        in_actor(full.trainers[0], embedding_only_update, make_batch(5))
        version = full.samplers.version + 1
        full.install(full.publish(version))
        with pytest.raises(CanaryError, match=rf"sampler_0 failed the weight canary after installing v{version}: "):
            full.samplers.settle_canary()
    finally:
        in_actor(engine, forget_tied_head, False)


def test_an_engine_woken_from_sleep_without_reloading_is_caught(full):
    engine = full.samplers.engines[0]
    in_actor(engine, sleep_without_reload, True)
    try:
        step(full, seed=6)
        in_actor(engine, fall_asleep)
        with pytest.raises(CanaryError, match=r"sampler_0 failed the weight canary after installing v\d+: "):
            step(full, seed=7)
    finally:
        in_actor(engine, sleep_without_reload, False)


def test_an_adapter_loaded_but_not_applied_is_caught_within_one_step_in_bf16(lora):
    engine = lora.samplers.engines[0]
    assert lora.start_canary()["sync/canary_gap"] < BOUNDS["bfloat16"]  # the base, and adapters of zeros
    in_actor(engine, adapter_not_applied, True)
    try:
        # the adapter's one update moves the canary less than bf16's bound: the engine's answer did not move at all
        stale = (
            "sampler_0 failed the weight canary after installing v1: its canary is bit for bit the one it gave for v0"
        )
        with pytest.raises(CanaryError, match=stale):
            step(lora, seed=0)
        assert in_actor(engine, adapters_loaded) == 1
    finally:
        in_actor(engine, adapter_not_applied, False)
