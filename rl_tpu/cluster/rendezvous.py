"""How the trainer ranks find each other and their devices: the rendezvous store the driver holds, gloo's network
interface, and each rank's accelerator."""

from __future__ import annotations

import os


class RendezvousStore:
    """The trainer ranks' rendezvous: torch's TCPStore, hosted by the driver for one start of the actors.

    The store binds a port the OS picks and holds it until closed: a port probed, released and bound later by
    rank 0 can be taken in between by any process of the node. The ranks, rank 0 too, connect as clients
    (`AGENT_STORE_ENV`, torch's switch for a store hosted outside the ranks, as torchrun's agent hosts it); after
    the rendezvous gloo connects the ranks to each other directly.
    """

    def __init__(self, world_size: int, timeout_s: float):
        from datetime import timedelta

        import ray
        import torch.distributed as dist

        self.host = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        self.store = dist.TCPStore(
            self.host, 0, world_size, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout_s)
        )
        self.port = self.store.port


# a trainer rank's environment: it is a client of the store `RendezvousStore` holds
AGENT_STORE_ENV = {"TORCHELASTIC_USE_AGENT_STORE": "True"}
# a CUDA trainer rank's environment: Ray leaves every GPU of the node visible, so that NCCL connects the ranks of a
# node peer to peer (with CUDA_VISIBLE_DEVICES narrowed to one GPU each, it cannot); each rank selects its own
ALL_GPUS_VISIBLE_ENV = {"RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES": "1"}


def set_rank_env(master_addr: str, master_port: int, rank: int, world_size: int) -> None:
    """Inside a trainer rank: the variables torch.distributed's env:// rendezvous reads (the store on rank 0's node)."""
    os.environ.update(
        MASTER_ADDR=master_addr,
        MASTER_PORT=str(master_port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK="0",
    )


def local_device_index() -> int:
    """Inside a trainer rank: its accelerator's index among those the process sees: the GPU Ray assigned it where
    every GPU is visible (`ALL_GPUS_VISIBLE_ENV`), else 0 (the one visible)."""
    if os.environ.get("RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES") != "1":
        return 0
    import ray

    if not ray.is_initialized():
        return 0
    ids = ray.get_gpu_ids()
    return int(ids[0]) if ids else 0


def in_ray_worker() -> bool:
    """Whether this process runs under Ray (a process without Ray installed does not: a GPU host's bare check)."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized()


def bind_gloo_to_node_ip() -> None:
    """Inside an actor: make gloo's sockets use the network interface of this node's IP.

    Gloo otherwise binds to what the host name resolves to, often 127.0.0.1 in containers, and
    trainer ranks on different hosts never connect. A `GLOO_SOCKET_IFNAME` the user set wins.
    """
    if "GLOO_SOCKET_IFNAME" in os.environ or not in_ray_worker():  # not in a Ray worker: one host
        return
    import psutil
    import ray

    ip = ray.util.get_node_ip_address()
    for interface, addresses in psutil.net_if_addrs().items():
        if any(address.address == ip for address in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = interface
            return
