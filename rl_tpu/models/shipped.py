"""Warm-started tiny presets shipped with the package (`rl_tpu/models/shipped/`), so that a cold cache starts in
seconds instead of minutes of supervised warm start.

Each folder is what `build_tiny_arith` wrote on the maintainers' host for one cache key (`resolve.preset_key`);
`manifest.json` gives each file's sha256 and the overrides that produce the key. A key hit is copied into the cache
after every file matches its checksum; a mismatch refuses, naming the file; a key miss (any setting changed)
builds as before. scripts/ship_tiny_models.py rebuilds the shipped presets and rewrites the manifest.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from pathlib import Path

SHIPPED = Path(__file__).parent / "shipped"
MANIFEST_NAME = "manifest.json"


def read_manifest(root: Path = SHIPPED) -> dict[str, dict]:
    """Folder (`tiny_arith-<key>`) -> {"name", "overrides": [...], "files": {file: sha256}}; empty if none ships."""
    path = root / MANIFEST_NAME
    return json.loads(path.read_text())["presets"] if path.is_file() else {}


def sha256_of(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def install_shipped(folder: Path, root: Path = SHIPPED) -> bool:
    """Copy the shipped preset named like `folder` into it, atomically, each file checked against the manifest.

    False where none is shipped under that name (the caller builds it); a file whose bytes differ from its
    checksum refuses, since serving it would start every run from weights nobody built."""
    entry = read_manifest(root).get(folder.name)
    if entry is None:
        return False
    tmp = folder.with_name(folder.name + f".partial{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name, expected in entry["files"].items():
        source = root / folder.name / name
        data = source.read_bytes() if source.is_file() else b""
        if sha256_of(data) != expected:
            shutil.rmtree(tmp, ignore_errors=True)
            raise ValueError(
                f"the shipped tiny model file {source} is missing or does not match its sha256 in "
                f"{root / MANIFEST_NAME}: reinstall rl_tpu (a checkout: scripts/ship_tiny_models.py rebuilds it)"
            )
        (tmp / name).write_bytes(data)
    shutil.rmtree(folder, ignore_errors=True)
    os.replace(tmp, folder)
    return True
