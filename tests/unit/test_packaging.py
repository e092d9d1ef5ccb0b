"""pyproject.toml lists every package folder (setuptools cannot find configs/, which ships as rl_tpu.configs), and
the house's size limits hold: few modules directly in rl_tpu/, none over 450 lines, no class over 200 lines."""

from __future__ import annotations

import ast
import tomllib

from conftest import REPO

MAX_TOP_MODULES, MAX_MODULE_LINES, MAX_CLASS_LINES = 10, 450, 200


def test_every_package_folder_is_listed_for_the_wheel():
    setuptools = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]
    # hydra_plugins is a namespace package (Hydra requires it to have no __init__.py)
    folders = {
        ".".join(p.parent.relative_to(REPO).parts)
        for top in ("rl_tpu", "rewards", "hydra_plugins")
        for p in (REPO / top).rglob("*.py")
        if "__pycache__" not in p.parts
    }
    assert set(setuptools["packages"]) == folders | {"rl_tpu.configs", "hydra_plugins"}
    assert setuptools["package-dir"] == {"rl_tpu.configs": "configs"}
    assert (REPO / "configs" / "recipe" / "grpo_math.yaml").is_file()


def test_every_file_a_package_reads_besides_its_modules_ships_in_the_wheel():
    """The rollout inspector's page is made of package files (rl_tpu/outputs/inspect/page.*): each is listed in
    package-data, and each file listed is there."""
    package_data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    folder = REPO / "rl_tpu" / "outputs" / "inspect"
    files = sorted(p.name for p in folder.iterdir() if p.is_file() and p.suffix != ".py")
    assert files == sorted(package_data["rl_tpu.outputs.inspect"]) == ["page.css", "page.html", "page.js"]


def test_the_package_keeps_its_shape():
    top = sorted(p.name for p in (REPO / "rl_tpu").glob("*.py"))
    assert len(top) <= MAX_TOP_MODULES, top
    too_long, too_large = [], []
    for path in (REPO / "rl_tpu").rglob("*.py"):
        text = path.read_text()
        if len(text.splitlines()) > MAX_MODULE_LINES:
            too_long.append(str(path.relative_to(REPO)))
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef) and node.end_lineno - node.lineno + 1 > MAX_CLASS_LINES:
                too_large.append(f"{path.relative_to(REPO)}:{node.name}")
    assert not too_long and not too_large, (too_long, too_large)


def test_each_recipe_folder_names_its_preset():
    folders = [p for p in (REPO / "recipes").iterdir() if p.is_dir() and not p.name.startswith("__")]
    assert folders
    for folder in folders:
        preset = f"configs/recipe/{folder.name}.yaml"
        assert (REPO / preset).is_file() and preset in (folder / "README.md").read_text(), folder.name


def test_test_files_have_unique_basenames():
    """pytest imports a test file by its basename (rootdir-relative packages are not used here): two tiers' files of
    one name make the second a collection error ("import file mismatch"), as tests/e2e/test_doctor.py did once."""
    names = [path.name for path in (REPO / "tests").rglob("test_*.py")]
    assert sorted({n for n in names if names.count(n) > 1}) == []
