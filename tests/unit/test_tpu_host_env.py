"""A host without TPU devices skips libtpu's metadata-server query (which hangs CPU backward passes for minutes
where torch-tpu is installed); a TPU VM's devices, or the user's own setting, leave it alone."""

from __future__ import annotations

import os
import subprocess
import sys

from conftest import REPO

from rl_tpu import host_has_tpu_devices


def test_tpu_devices_are_recognised(tmp_path):
    assert not host_has_tpu_devices(tmp_path)
    (tmp_path / "vfio").mkdir()
    (tmp_path / "vfio" / "vfio").touch()  # the VFIO control file alone: no TPU
    assert not host_has_tpu_devices(tmp_path)
    (tmp_path / "vfio" / "0").touch()
    assert host_has_tpu_devices(tmp_path)
    (tmp_path / "vfio" / "0").unlink()
    (tmp_path / "accel0").touch()
    assert host_has_tpu_devices(tmp_path)


def skip_value(env: dict) -> str:
    probe = "import rl_tpu, os; print(os.environ.get('TPU_SKIP_MDS_QUERY'))"
    return subprocess.run(
        [sys.executable, "-c", probe], cwd=REPO, env=env, capture_output=True, text=True, check=True
    ).stdout.strip()


def test_importing_rl_tpu_sets_the_skip_on_this_host_unless_the_user_chose():
    env = {k: v for k, v in os.environ.items() if k != "TPU_SKIP_MDS_QUERY"}
    assert skip_value(env) == ("None" if host_has_tpu_devices() else "1")
    assert skip_value({**env, "TPU_SKIP_MDS_QUERY": "0"}) == "0"
