"""Rebuild the warm-started tiny presets that ship with the package and rewrite their manifest.

    python scripts/ship_tiny_models.py                  # build each preset below, ship it, rewrite the manifest
    python scripts/ship_tiny_models.py --from ~/.cache/rl_tpu   # ship the cache's folders of those keys instead
    python scripts/ship_tiny_models.py --check          # build each, compare with the shipped files bit for bit

Run it after changing a preset default, the warm start or the data split (tests/unit/test_shipped_models.py fails
until the manifest's keys are the recipes' keys again). The builds take the recipes' warm-start time, one after
the other (274 and 1,968 s on a 2-core Intel Xeon, 2026-12-07).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# name -> the Hydra overrides whose preset ships: the recipes that start from a warm start. Not shipped: the
# learning-band test fixture's (random weights: seconds to build) and the episodes fixture's (150 steps x 32
# examples; tiny_arith-54b21b53b5ab), which build as before.
PRESETS = {
    "grpo_math": ["+recipe=grpo_math"],
    "tool_math": ["+recipe=tool_math"],
}


def compose(overrides: list[str]):
    """The run config those overrides make, as a run gets it."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf import OmegaConf

    from rl_tpu.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(REPO / "configs"), version_base=None):
        return OmegaConf.to_object(hydra_compose("config", overrides=overrides))


def folder_name(overrides: list[str]) -> str:
    from rl_tpu.models.resolve import preset_folder_name

    cfg = compose(overrides)
    return preset_folder_name(cfg.model.tiny, cfg.data)


def build(overrides: list[str], folder: Path) -> None:
    from rl_tpu.models.resolve import build_tiny_arith

    cfg = compose(overrides)
    build_tiny_arith(cfg.model.tiny, cfg.data, folder)


def checksums(folder: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir()) if p.is_file()}


def ship(source_cache: Path | None) -> None:
    from rl_tpu.models.shipped import MANIFEST_NAME, SHIPPED

    presets = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in PRESETS.items():
            folder = folder_name(overrides)
            source = source_cache / "models" / folder if source_cache else Path(tmp) / folder
            if source_cache is None:
                build(overrides, source)
            if not (source / "model.safetensors").is_file():
                sys.exit(f"{name}: no built preset in {source}")
            shutil.rmtree(SHIPPED / folder, ignore_errors=True)
            shutil.copytree(source, SHIPPED / folder)
            presets[folder] = {"name": name, "overrides": overrides, "files": checksums(SHIPPED / folder)}
            print(f"{name}: shipped {folder} ({sum(p.stat().st_size for p in (SHIPPED / folder).iterdir())} bytes)")
    for stale in SHIPPED.glob("tiny_arith-*"):
        if stale.name not in presets:
            shutil.rmtree(stale)
    (SHIPPED / MANIFEST_NAME).write_text(json.dumps({"presets": presets}, indent=2) + "\n")


def check() -> bool:
    """Build each shipped preset here and compare it with the shipped files, file by file."""
    from rl_tpu.models.shipped import read_manifest

    same = True
    with tempfile.TemporaryDirectory() as tmp:
        for folder, entry in read_manifest().items():
            build(entry["overrides"], Path(tmp) / folder)
            built = checksums(Path(tmp) / folder)
            differ = sorted(n for n in entry["files"] if built.get(n) != entry["files"][n])
            print(f"{entry['name']} ({folder}): " + (f"DIFFERS in {differ}" if differ else "identical, bit for bit"))
            same = same and not differ
    return same


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--from", dest="source", type=Path, help="a cache folder holding the built presets")
    parser.add_argument("--check", action="store_true", help="build and compare with the shipped files")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    if args.check:
        sys.exit(0 if check() else 1)
    ship(args.source.expanduser() if args.source else None)


if __name__ == "__main__":
    main()
