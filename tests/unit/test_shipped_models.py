"""The warm-started tiny presets shipped in rl_tpu/models/shipped/: their keys are the recipes' keys (a changed
preset default becomes a key miss and a build, never stale weights), their files match the manifest's checksums,
a cold cache gets them without a warm start, and a corrupt file is refused by name."""

from __future__ import annotations

import hashlib
import shutil
import sys
import tomllib
from pathlib import PurePosixPath

import pytest
from conftest import REPO

from rl_tpu.models import resolve
from rl_tpu.models.shipped import SHIPPED, install_shipped, read_manifest

sys.path.insert(0, str(REPO / "scripts"))
import ship_tiny_models  # noqa: E402

GRPO_MATH = ["+recipe=grpo_math"]


def test_the_manifest_holds_the_keys_the_recipes_make_now():
    """A preset default changed since the weights shipped: its recipe's key moved; run scripts/ship_tiny_models.py."""
    manifest = read_manifest()
    keys = {ship_tiny_models.folder_name(overrides): name for name, overrides in ship_tiny_models.PRESETS.items()}
    assert {folder: entry["name"] for folder, entry in manifest.items()} == keys
    assert set(keys.values()) == {"grpo_math", "tool_math"}
    for entry in manifest.values():
        assert entry["overrides"] == ship_tiny_models.PRESETS[entry["name"]]


def test_the_shipped_files_match_their_checksums_and_are_all_listed():
    for folder, entry in read_manifest().items():
        assert sorted(p.name for p in (SHIPPED / folder).iterdir()) == sorted(entry["files"])
        for name, digest in entry["files"].items():
            assert hashlib.sha256((SHIPPED / folder / name).read_bytes()).hexdigest() == digest, f"{folder}/{name}"


def test_a_cold_cache_gets_the_shipped_preset_without_a_warm_start(tmp_path, monkeypatch):
    def no_build(*args):
        raise AssertionError("built the preset although it ships")

    monkeypatch.setattr(resolve, "build_tiny_arith", no_build)
    cfg = ship_tiny_models.compose(GRPO_MATH)
    folder = resolve.resolve_model_path(cfg.model, cfg.data, tmp_path)
    assert folder.parent == tmp_path / "models"
    for name in read_manifest()[folder.name]["files"]:
        assert (folder / name).read_bytes() == (SHIPPED / folder.name / name).read_bytes()


def test_a_changed_setting_is_a_key_miss_and_builds(tmp_path, monkeypatch):
    built = []
    monkeypatch.setattr(resolve, "build_tiny_arith", lambda tiny, data, folder: built.append(folder))
    cfg = ship_tiny_models.compose([*GRPO_MATH, "model.tiny.warm_start_steps=1199"])
    folder = resolve.resolve_model_path(cfg.model, cfg.data, tmp_path)
    assert built == [folder] and folder.name not in read_manifest()


def test_a_shipped_file_that_fails_its_checksum_is_refused_by_name(tmp_path):
    shipped = tmp_path / "shipped"
    shutil.copytree(SHIPPED, shipped)
    folder = next(iter(read_manifest()))
    with open(shipped / folder / "model.safetensors", "r+b") as f:  # one flipped byte in the weights
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 1]))
    cache = tmp_path / "cache" / folder
    with pytest.raises(ValueError, match=f"{shipped / folder / 'model.safetensors'} is missing or does not match"):
        install_shipped(cache, shipped)
    assert not cache.exists() and not list(cache.parent.glob("*.partial*"))
    assert install_shipped(tmp_path / "cache" / "tiny_arith-000000000000", shipped) is False


def test_the_wheel_carries_every_shipped_file():
    patterns = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"][
        "rl_tpu.models"
    ]
    models = REPO / "rl_tpu" / "models"
    for path in SHIPPED.rglob("*"):
        if path.is_file():
            assert any(PurePosixPath(path.relative_to(models).as_posix()).match(p) for p in patterns), path
