"""The trainer ranks' rendezvous: the port is the driver's from the moment it is chosen, and the ranks join as
clients of it (rank 0 too), as torch does when an agent hosts the store."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import pytest

from rl_tpu.cluster.rendezvous import AGENT_STORE_ENV, RendezvousStore

RANK = """
import torch, torch.distributed as dist
dist.init_process_group("gloo")
total = torch.tensor([dist.get_rank() + 1.0])
dist.all_reduce(total)
print(int(total.item()))
dist.destroy_process_group()
"""


def test_the_port_is_held_from_the_start_and_the_ranks_join_as_clients():
    store = RendezvousStore(world_size=2, timeout_s=60)
    with socket.socket() as other, pytest.raises(OSError):  # no other process can take it meanwhile
        other.bind((store.host, store.port))
    env = {**os.environ, **AGENT_STORE_ENV, "MASTER_ADDR": store.host, "MASTER_PORT": str(store.port)}
    env.update(WORLD_SIZE="2", OMP_NUM_THREADS="1")
    ranks = [
        subprocess.Popen([sys.executable, "-c", RANK], env={**env, "RANK": str(r)}, stdout=subprocess.PIPE, text=True)
        for r in range(2)
    ]
    assert [p.communicate(timeout=120)[0].strip() for p in ranks] == ["3", "3"]
    assert [p.returncode for p in ranks] == [0, 0]
