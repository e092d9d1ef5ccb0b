"""The shm_file transport reclaims the bundles of senders that died without cleaning up (a SIGKILLed trainer
rank 0 leaves whole model versions in RAM), keeps a live sender's, and checks its room at start."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rl_tpu.records import WeightSyncError
from rl_tpu.sync.shm_file import ShmFileTransport


def dead_pid() -> int:
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def test_a_dead_senders_bundles_are_reclaimed_and_a_live_ones_kept(tmp_path):
    dead, live = tmp_path / f"sender-{dead_pid()}", tmp_path / f"sender-{os.getppid()}"
    for folder in (dead, live):
        (folder / "v2").mkdir(parents=True)
        (folder / "v2" / "bucket00000.safetensors").write_bytes(b"x" * 1024)
    ShmFileTransport(str(tmp_path))
    assert not dead.exists() and live.exists()


def test_too_little_room_for_two_bundles_is_refused_at_start_naming_both_sizes(tmp_path):
    transport = ShmFileTransport(str(tmp_path))
    transport.prepare(1024)  # a small bundle fits
    with pytest.raises(WeightSyncError, match=r"MiB free, and the run keeps two weight bundles of .* MiB there"):
        transport.prepare(2**62)
    transport.close()


SENDER = """
import sys, time
import numpy as np, torch
from rl_tpu.sync.shm_file import ShmFileTransport
sender = ShmFileTransport(sys.argv[1])
sender.prepare(1024)
for version in (1, 2):
    sender.put(version, 0, {"w": torch.ones(256)}, [])
print(sender.root, flush=True)
time.sleep(600)
"""


def test_the_bundles_of_a_sender_killed_with_sigkill_are_reclaimed_by_the_next_sender(tmp_path):
    process = subprocess.Popen([sys.executable, "-c", SENDER, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    folder = Path(process.stdout.readline().strip())
    assert sorted(p.name for p in folder.iterdir()) == ["v1", "v2"]  # two versions in RAM
    process.kill()  # SIGKILL: no close(), no atexit
    process.wait()
    assert folder.exists()
    ShmFileTransport(str(tmp_path))
    assert not folder.exists()
