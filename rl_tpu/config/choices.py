"""The choices of the config's enum keys (Hydra lists them when a value is not one).

Each is a `StrEnum`: a member is its value as a string (compared, formatted, or handed to vLLM and verl as one), so
code reads a setting as the string it names; a program may also set a plain string.
"""

from __future__ import annotations

from enum import StrEnum


class DeviceKind(StrEnum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"
    tpu = "tpu"


class Layout(StrEnum):
    auto = "auto"  # disaggregated when the devices can hold trainer and engines apart, else colocated
    colocated = "colocated"  # engines share the trainer ranks' devices (on CUDA they sleep while it trains)
    disaggregated = "disaggregated"  # engines on devices of their own


class PinCores(StrEnum):
    auto = "auto"  # pinned on a one-host CPU run in async mode (trainer and engines compute at once)
    on = "on"  # pinned on every CPU node
    off = "off"  # the OS schedules every actor's threads anywhere


class DType(StrEnum):
    float32 = "float32"
    bfloat16 = "bfloat16"


class ResumeMode(StrEnum):
    off = "off"  # start at step 0 (or at trainer.resume_from)
    auto = "auto"  # continue from the run folder's newest complete checkpoint, if it has one


class Tracker(StrEnum):
    console = "console"  # the progress bar
    jsonl = "jsonl"  # metrics.jsonl: always written (resume and the reports read it)
    tensorboard = "tensorboard"
    wandb = "wandb"
    mlflow = "mlflow"
    trackio = "trackio"
    swanlab = "swanlab"
    clearml = "clearml"


# verl's names, dashes and all: OmegaConf looks enum values up by member name, so the names are verl's strings
LossAggMode = StrEnum(
    "LossAggMode",
    {
        mode: mode
        for mode in (
            "token-mean",
            "token-sum",
            "seq-mean-token-sum",
            "seq-mean-token-mean",
            "seq-mean-token-sum-norm",  # Dr. GRPO: token sums over a constant length
        )
    },
)


class OldLogprobSource(StrEnum):
    trainer = "trainer"  # recomputed by the trainer before the first update (verl's default)
    sampler = "sampler"  # the sampler's own logprobs (no extra forward; the ratio also holds the mismatch)


class RolloutIS(StrEnum):
    auto = "auto"  # token-level in async mode, off in the synchronous loop
    token = "token"  # per-token truncated importance weights (TIS)
    sequence = "sequence"  # one weight per sequence: the product of its token ratios, truncated
    off = "off"


class OutcomePolicy(StrEnum):
    """What the learning signal does with a rollout of one outcome (`algorithm.outcomes`, docs/algorithms.md)."""

    # play it again in fresh tool instances (a tool's failure, timeout or lost instance) or grade it again (a reward's
    # failure or timeout), up to algorithm.outcomes.max_retries times; then algorithm.outcomes.fallback
    retry = "retry"
    mask = "mask"  # out of the loss and out of its group's mean and standard deviation
    fail_group = "fail_group"  # its whole group out of the loss and of the statistics
    zero = "zero"  # trained on with the reward it got (a failed reward's 0.0)
