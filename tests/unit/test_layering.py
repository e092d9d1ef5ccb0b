"""The layering rule (docs/development.md) holds: import-linter's contracts in pyproject.toml pass on rl_tpu, a
forbidden import added to a copy of the package breaks them, and no module of rl_tpu is in an import circle."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest
from conftest import REPO

LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(root), "PATH": "/usr/bin:/bin"}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120
    )


def test_the_contracts_hold():
    result = lint_imports(REPO)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


@pytest.mark.parametrize(
    ("module", "forbidden", "contract"),
    [
        ("trainer/weights.py", "from rl_tpu.sampler import engine", "roles"),  # a role importing another
        ("sampler/pool.py", "from rl_tpu.outputs import report", "roles"),  # the reporting stack in an engine
        ("models/hf.py", "from rl_tpu.cluster import placement", "lower"),  # a lower layer importing an upper one
        ("records.py", "from rl_tpu.config import RunConfig", "bottom"),  # the bottom layer's parts are independent
        ("sync/base.py", "from rl_tpu.sync import registry", "sync"),  # the base imports nothing else of sync
    ],
)
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, forbidden, contract):
    shutil.copytree(REPO / "rl_tpu", tmp_path / "rl_tpu", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "pyproject.toml", tmp_path)
    assert lint_imports(tmp_path).returncode == 0  # the copy is as good as the original
    path = tmp_path / "rl_tpu" / module
    path.write_text(path.read_text() + f"\n{forbidden}  # added by the test ({contract})\n")
    result = lint_imports(tmp_path)
    assert result.returncode != 0, result.stdout
    importer = "rl_tpu." + module.removesuffix(".py").replace("/", ".")
    assert importer in result.stdout and "BROKEN" in result.stdout


def test_no_module_is_in_an_import_circle():
    graph = grimp.build_graph("rl_tpu", cache_dir=None)
    circles = [
        (a, b)
        for a in graph.modules
        for b in graph.find_modules_directly_imported_by(a)
        if b != a
        and not b.startswith(a + ".")
        and graph.chain_exists(importer=b, imported=a)
        and not a.startswith(b + ".")
    ]
    assert not circles, circles
