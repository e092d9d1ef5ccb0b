"""A Hugging Face folder from any checkpoint, and the model card of an exported policy.

    python -m rl_tpu.export outputs/2026-12-02/10-00-00 OUT                    # the run's newest checkpoint
    python -m rl_tpu.export outputs/2026-12-02/10-00-00/checkpoints/step_40 OUT --dtype bfloat16

Each checkpoint carries the model's config and tokenizer (`hf/`, written with it), so a checkpoint is
enough on its own. The weights come from the checkpoint's model state (the trainer's fp32 master weights),
cast to the run's served dtype (`model.dtype`) unless `--dtype` says otherwise, and are written by
`save_pretrained`, sharded at the run's `sync.bucket_mb`. Unlike the trainer's own export at the end of a run,
which streams bucket by bucket, this one holds the whole model in memory once, in fp32.
"""

from __future__ import annotations

import argparse
import logging
import re
import shlex
from pathlib import Path

import yaml

from rl_tpu.models.hf import LORA_BASE_FILE, MODEL_FILES, copy_model_files
from rl_tpu.outputs import checkpoints
from rl_tpu.outputs.metrics import final_accuracy, read_metrics
from rl_tpu.outputs.report import run_overrides

log = logging.getLogger(__name__)


def run_settings(checkpoint: Path) -> dict:
    """The resolved config of the run that wrote `checkpoint` (RUN/checkpoints/step_N); {} if it is not there."""
    path = checkpoint.parent.parent / "resolved_config.yaml"
    return yaml.safe_load(path.read_text()) if path.is_file() else {}


def load_policy(checkpoint: Path):
    """The checkpoint's policy as a `transformers` model in fp32 (built from the checkpoint's own config)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_tpu.models.hf import hf_name
    from rl_tpu.models.safe_checkpoint import check_metadata, load_state

    metadata = check_metadata(checkpoint)  # before anything else of the checkpoint is read
    if (checkpoint / LORA_BASE_FILE).is_file():
        raise ValueError(
            f"{checkpoint}: a LoRA checkpoint holds the adapter alone; its run writes the adapter as a PEFT folder "
            "(RUN/export, and RUN/export_merged with actor.lora.export_merged=true): exporting a LoRA checkpoint "
            "on its own is not supported yet"
        )
    files = checkpoint / MODEL_FILES
    if not (files / "config.json").is_file():
        raise FileNotFoundError(
            f"{checkpoint}: no {MODEL_FILES}/config.json; checkpoints written before rl_tpu "
            "saved the model's files with them cannot be exported on their own"
        )
    config = AutoConfig.from_pretrained(files)
    # built on the CPU, not the meta device, so that non-persistent buffers (rotary frequencies) are computed
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    stored = {
        hf_name(key.removeprefix("model.")): key.removeprefix("model.")
        for key in metadata.state_dict_metadata
        if key.startswith("model.")
    }
    wanted, missing = {}, []
    for name, tensor in model.state_dict().items():
        if name in stored:
            wanted[stored[name]] = tensor
        elif not (name == "lm_head.weight" and config.tie_word_embeddings):  # tied: stored as the embedding
            missing.append(name)
    if missing:
        raise KeyError(
            f"{checkpoint}: the checkpoint's model state has no {', '.join(missing[:4])}"
            f"{' ...' if len(missing) > 4 else ''} ({len(missing)} of the model's tensors missing)"
        )
    # in place, into the model's tensors
    load_state({"model": wanted}, checkpoint, no_dist=True)
    return model.eval()


def export_checkpoint(checkpoint: str | Path, out: str | Path, dtype: str | None = None) -> Path:
    """Write CHECKPOINT (a run folder or a step_N folder) as a Hugging Face folder at OUT; returns OUT."""
    import torch

    checkpoint = checkpoints.latest(Path(checkpoint), "CHECKPOINT")
    settings = run_settings(checkpoint)
    dtype = dtype or settings.get("model", {}).get("dtype", "float32")
    bucket_mb = settings.get("sync", {}).get("bucket_mb", 512)
    model = load_policy(checkpoint).to(getattr(torch, dtype))
    out = Path(out)
    copy_model_files(checkpoint / MODEL_FILES, out)
    model.save_pretrained(out, max_shard_size=f"{int(bucket_mb)}MB")
    run_dir = checkpoint.parent.parent
    if (run_dir / "metrics.jsonl").is_file():
        write_model_card(out, run_dir, dtype, checkpoints.step_of(checkpoint), f"checkpoint {checkpoint.name}")
    return out


# an absolute or home-relative path in an override's value: the whole value, or an item of a list
LOCAL_PATH = re.compile(r"(?<=[=\[,])(?:/|~)[^,\]]*")


def without_local_path(override: str) -> str:
    """`KEY=VALUE` with each absolute or home-relative path in VALUE (a list's items too) cut to its last part: a
    model card names no local path (it is uploaded with the export)."""
    return LOCAL_PATH.sub(lambda path: f".../{Path(path.group()).name}", override)


def write_model_card(
    folder: Path,
    run_dir: Path,
    dtype: str,
    step: int | None = None,
    source: str = "the end of the run",
    adapter: bool = False,
) -> None:
    """README.md in an exported folder: how the policy was trained, what it reached by `step` (None: the last
    step logged), and the command. `adapter`: the folder holds a LoRA policy's PEFT adapter."""
    overrides = [without_local_path(o) for o in run_overrides(run_dir)]
    rows = [r for r in read_metrics(run_dir / "metrics.jsonl") if step is None or r["step"] <= step]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    steps = max((r["step"] for r in rows), default=0)
    recipe = next((o.split("=", 1)[1] for o in overrides if o.startswith("+recipe=")), "(none)")
    accuracy = (
        f"{100 * evals[0]:.1f}% before training -> {100 * final_accuracy(evals):.1f}% after"
        if evals
        else "no evaluation recorded"
    )
    what = "a LoRA adapter (PEFT; its base model is in adapter_config.json)" if adapter else "weights"
    (folder / "README.md").write_text(f"""---
library_name: {"peft" if adapter else "transformers"}
tags: [rl_tpu, grpo, reinforcement-learning]
---
# Policy trained with rl_tpu

- recipe: `{recipe}`; exported from {source} (step {steps}), {what} in {dtype}
- held-out accuracy (the recipe's reward, greedy): {accuracy}
- run folder: `{run_dir.name}`

Trained with:

```bash
{shlex.join(["rl-tpu", *overrides])}
```
""")


def push_to_hub(folder: Path, repo_id: str, public: bool = False) -> bool:
    """Upload an exported folder to a Hub repository. A new repository is made private, and an existing public one
    is refused unless `public` (`export.public=true`; `--public` on the command line): a trained policy never
    becomes public by accident. Offline, no token, no rights, refused: a warning, and the export stays on disk."""
    try:
        from huggingface_hub import HfApi

        api = HfApi()
        if not api.repo_exists(repo_id):
            api.create_repo(repo_id, private=True)
        elif not api.repo_info(repo_id).private and not public:
            log.warning(
                "push to hub %s refused: the repository is public (export.public=true uploads into it anyway); "
                "the export stays in %s",
                repo_id,
                folder,
            )
            return False
        api.upload_folder(repo_id=repo_id, folder_path=str(folder), commit_message="rl_tpu export")
    except Exception as failed:
        log.warning(
            "push to hub %s failed (%s: %s); the export stays in %s", repo_id, type(failed).__name__, failed, folder
        )
        return False
    log.info("pushed %s to %s", folder, repo_id)
    return True


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl_tpu.export", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a run folder (its newest complete checkpoint) or RUN/checkpoints/step_N")
    parser.add_argument("out", help="the Hugging Face folder to write")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], help="default: the run's model.dtype")
    parser.add_argument("--push-to-hub", metavar="REPO", help="also upload the folder to this Hub repository")
    parser.add_argument("--public", action="store_true", help="let --push-to-hub upload into a public repository")
    args = parser.parse_args(argv)
    out = export_checkpoint(args.checkpoint, args.out, args.dtype)
    print(f"exported {out}")
    if args.push_to_hub:
        push_to_hub(out, args.push_to_hub, public=args.public)


if __name__ == "__main__":
    main()
