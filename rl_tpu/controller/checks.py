"""Checks that span several config sections, made once before Ray starts; each names the keys and what is allowed."""

from __future__ import annotations

from pathlib import Path

from rl_tpu.algorithms import core as algorithms
from rl_tpu.algorithms import kl_reward
from rl_tpu.cluster import placement
from rl_tpu.cluster.device import Device
from rl_tpu.config import RunConfig, value_of
from rl_tpu.controller import batch_shaping
from rl_tpu.grader.grader import reward_sources
from rl_tpu.models.safe_checkpoint import check_metadata
from rl_tpu.outputs import checkpoints


def validate(cfg: RunConfig) -> None:
    """Value checks the type system cannot express; each names the key and what is allowed. Each config section
    checks its own fields (`__post_init__`, again in `cfg.check()`); these span sections or need other parts."""
    cfg.check()
    reward_names = [s.label for s in reward_sources(cfg.reward, cfg.custom_reward_function)]
    algorithms.validate(cfg, reward_names)
    kl_reward.validate(cfg.algorithm)
    batch_shaping.validate(cfg.algorithm.filter_groups, reward_names, cfg.reward.overlong_buffer, cfg.completion_tokens)
    if cfg.trainer.resume_from:
        # names the folder if there is nothing to resume, and refuses a checkpoint that would run code
        check_metadata(checkpoints.latest(Path(cfg.trainer.resume_from).expanduser()))
    per_step = cfg.data.train_batch_size * cfg.sampler.n
    if per_step % cfg.trainer.world_size:
        raise ValueError(
            f"data.train_batch_size * sampler.n = {per_step} sequences must divide evenly over "
            f"trainer.world_size={cfg.trainer.world_size}"
        )
    if value_of(cfg.sync.transport) == "tpu_sync" and cfg.trainer.is_async:
        raise ValueError(
            f"sync.transport=tpu_sync with trainer.max_staleness={cfg.trainer.max_staleness}: an engine reads TPU "
            "Sync's staging buffers in place, and in async mode the next push could overwrite them between their "
            "check and their load; use trainer.max_staleness=0 or sync.transport=object_store"
        )
    placement.check_request(cfg)
    if cfg.ray.address is None and value_of(cfg.device) in ("cuda", "tpu"):
        Device.resolve(cfg.device)  # a local cluster is this host: a missing accelerator fails now, not after Ray
