"""The torch step of the install on a user's box: pip's local wheel configuration off, stand-in indexes served
from local folders (one for the registry, one for PyTorch's CPU index), pip asked for a dry run. It takes the CPU
build from PyTorch's index, from pip's own sources where they hold it, and falls back to plain torch, saying so."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
from conftest import REPO


def fake_wheel(folder: Path, version: str, name: str = "torch", requires: str = "") -> None:
    """A torch wheel of `version` holding only its metadata (what pip reads to choose and resolve it), in a PEP 503
    project page under `folder`/simple."""
    project = folder / "simple" / name
    project.mkdir(parents=True, exist_ok=True)
    stem = name.replace("-", "_")  # a wheel's file name spells the project with underscores
    info, file = f"{stem}-{version}.dist-info", f"{stem}-{version}-py3-none-any.whl"
    (project / "index.html").write_text(f'<!DOCTYPE html><html><body><a href="{file}">{file}</a></body></html>')
    metadata = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n" + (
        f"Requires-Dist: {requires}\n" if requires else ""
    )
    with zipfile.ZipFile(project / file, "w") as wheel:
        wheel.writestr(f"{stem}/__init__.py", "")
        wheel.writestr(f"{info}/METADATA", metadata)
        wheel.writestr(
            f"{info}/WHEEL", "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        wheel.writestr(f"{info}/RECORD", "")


def install_torch(tmp_path: Path, registry: Path, cpu_index: Path, *options: str, **env: str) -> tuple[dict, str]:
    """({package: version} pip would install, what the script said)."""
    report = tmp_path / "report.json"
    environment = {
        "PATH": f"{Path(sys.executable).parent}:/usr/bin:/bin",
        "HOME": str(tmp_path),
        "PIP_CONFIG_FILE": os.devnull,  # no configuration file: no local wheel folder, no mirror
        "PIP_NO_CACHE_DIR": "1",
        "PIP_DISABLE_PIP_VERSION_CHECK": "1",
        "PIP_INDEX_URL": (registry / "simple").as_uri(),
        "RL_TPU_TORCH_CPU_INDEX": (cpu_index / "simple").as_uri(),
        **env,
    }
    result = subprocess.run(
        ["bash", "scripts/install_torch.sh", *options, "--dry-run", "--ignore-installed", "--report", str(report)],
        cwd=REPO,
        env=environment,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    chosen = {p["metadata"]["name"]: p["metadata"]["version"] for p in json.loads(report.read_text())["install"]}
    return chosen, result.stdout


@pytest.fixture
def indexes(tmp_path):
    registry, cpu_index, empty = tmp_path / "registry", tmp_path / "cpu-index", tmp_path / "empty"
    fake_wheel(registry, "2.13.0", requires="nvidia-cudnn")  # the registry has the default (CUDA) build only
    fake_wheel(registry, "9.0", name="nvidia-cudnn")
    fake_wheel(cpu_index, "2.13.0+cpu")
    (empty / "simple").mkdir(parents=True)
    return registry, cpu_index, empty


def test_a_users_box_gets_the_cpu_build_from_pytorchs_index(tmp_path, indexes):
    registry, cpu_index, _ = indexes
    chosen, said = install_torch(tmp_path, registry, cpu_index)
    assert chosen == {"torch": "2.13.0+cpu"} and "the CPU build, from PyTorch's CPU wheel index" in said


def test_pips_own_sources_are_used_first_where_they_hold_the_cpu_build(tmp_path, indexes):
    registry, cpu_index, empty = indexes
    chosen, said = install_torch(tmp_path, registry, empty, PIP_FIND_LINKS=str(cpu_index / "simple" / "torch"))
    assert chosen == {"torch": "2.13.0+cpu"} and "the CPU build, from the sources pip is configured with" in said


def test_without_the_cpu_index_it_falls_back_to_plain_torch_and_says_what_that_costs(tmp_path, indexes):
    registry, _, empty = indexes
    chosen, said = install_torch(tmp_path, registry, empty, "--no-deps")  # as the locked install asks
    assert chosen == {"torch": "2.13.0", "nvidia-cudnn": "9.0"}  # the CUDA build with its libraries
    assert "gave no torch 2.13.0+cpu" in said and "CUDA build" in said and "not the CPU build" in said
