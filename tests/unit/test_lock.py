"""The lock (requirements/lock/*.txt, made by scripts/lock.sh) is what the install uses: every package at an exact
version with its hashes, made from the .txt inputs as they are now, satisfying each of them, installed here as
locked; and pip, as scripts/install.sh calls it, refuses a file whose hash is not the locked one."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import re
import subprocess
import sys
import zipfile

import pytest
from conftest import REPO
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

LOCK = REPO / "requirements" / "lock"
RUNTIME_INPUTS = ("requirements/cpu.txt", "requirements/common.txt", "requirements/no-deps-cpu.txt")
DEV_INPUTS = ("requirements/dev.txt",)


def locked(name: str) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, hashes)} of a lock file."""
    text = (LOCK / f"{name}.txt").read_text().replace("\\\n", " ")
    entries = {}
    for line in text.splitlines():
        if line.strip() and not line.startswith("#"):
            spec, *options = line.split()
            package, _, version = spec.partition("==")
            entries[canonicalize_name(package.split("[")[0])] = (version, re.findall(r"--hash=sha256:(\w+)", line))
    return entries


def requirements(paths) -> list[Requirement]:
    lines = (line.split("#")[0].strip() for path in paths for line in (REPO / path).read_text().splitlines())
    return [Requirement(line) for line in lines if line and not line.startswith("-")]


def test_every_locked_package_has_an_exact_version_and_hashes_and_torch_is_left_to_its_own_step():
    for name in ("cpu", "dev"):
        entries = locked(name)
        assert len(entries) > (100 if name == "cpu" else 5)
        for package, (version, hashes) in entries.items():
            assert re.fullmatch(r"[\w.+!-]+", version) and hashes, package
        assert "torch" not in entries


def test_the_lock_was_made_from_the_inputs_as_they_are():
    for name in ("cpu", "dev"):
        header = re.findall(r"^#   ([0-9a-f]{64})  (\S+)$", (LOCK / f"{name}.txt").read_text(), re.M)
        assert {path for _, path in header} == {*RUNTIME_INPUTS, *DEV_INPUTS}
        for digest, path in header:
            assert hashlib.sha256((REPO / path).read_bytes()).hexdigest() == digest, (
                f"{path} changed since requirements/lock/{name}.txt was made: run scripts/lock.sh"
            )


@pytest.mark.parametrize(("lock", "inputs"), [("cpu", RUNTIME_INPUTS), ("dev", DEV_INPUTS)])
def test_the_lock_satisfies_every_input(lock, inputs):
    entries = {**locked("cpu"), **locked("dev")} if lock == "dev" else locked("cpu")
    for requirement in requirements(inputs):
        name = canonicalize_name(requirement.name)
        if name == "torch" or (requirement.marker and not requirement.marker.evaluate()):
            continue
        assert name in entries, f"{requirement} is not in requirements/lock/{lock}.txt"
        assert requirement.specifier.contains(entries[name][0], prereleases=True), (requirement, entries[name][0])


def test_this_environment_has_the_locked_versions():
    wrong = {}
    for package, (version, _) in {**locked("cpu"), **locked("dev")}.items():
        try:
            installed = md.version(package)
        except md.PackageNotFoundError:
            installed = None
        if installed != version:
            wrong[package] = (installed, version)
    assert not wrong, f"installed vs locked: {wrong}"


def test_pip_as_the_install_calls_it_refuses_a_file_whose_hash_is_not_locked(tmp_path):
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    wheel = wheels / "tiny_pkg-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("tiny_pkg/__init__.py", "")
        archive.writestr("tiny_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tiny-pkg\nVersion: 1.0\n")
        archive.writestr(
            "tiny_pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        )
        archive.writestr("tiny_pkg-1.0.dist-info/RECORD", "")
    good = hashlib.sha256(wheel.read_bytes()).hexdigest()

    def download(digest: str) -> subprocess.CompletedProcess:
        lock = tmp_path / "lock.txt"
        lock.write_text(f"tiny-pkg==1.0 \\\n    --hash=sha256:{digest}\n")
        command = [sys.executable, "-m", "pip", "download", "--require-hashes", "--no-deps", "--no-index"]
        command += ["--find-links", str(wheels), "-r", str(lock), "-d", str(tmp_path / "out")]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    assert download(good).returncode == 0
    tampered = download(good[:-1] + ("0" if good[-1] != "0" else "1"))
    assert tampered.returncode != 0 and "DO NOT MATCH THE HASHES" in tampered.stderr
