"""`sync.transport=collective`: each bucket one gloo broadcast from trainer rank 0 to every engine, in order.

The group is created on the first bundle and bound to rank 0's node address.
"""

from __future__ import annotations

import queue
import threading
from datetime import timedelta
from typing import Any

import numpy as np
import torch

from rl_tpu.records import Bucket
from rl_tpu.sync.base import SenderSetting, Transport


class CollectiveTransport(Transport):
    """Broadcasts over a gloo group {trainer rank 0: 0, engine i: i + 1}, made on the first bundle.

    `put` only queues a bucket and returns; a sender thread broadcasts the queue in order once the
    receiver has joined, so publishing never waits for the sampler. The receiver reads every bucket
    of a bundle in order (see `unpack`), which keeps both ends of the stream aligned.
    """

    name = "collective"
    # every engine joins one group and reads every broadcast: a lost engine ends the run (trainer.max_restarts)
    through_host = True
    # A peer that died mid-stream surfaces as an error on the other side after this long, not a hang.
    timeout = timedelta(minutes=5)
    _receiver_groups: dict[tuple[str, int], Any] = {}

    def __init__(self, host: str = "127.0.0.1", receivers: int = 1):
        # `host`: the sender's node address, which the engines on other nodes connect to
        self.host, self.size, self.store, self.queue = host, receivers + 1, None, queue.Queue()

    @classmethod
    def sender(cls, setting: SenderSetting) -> "CollectiveTransport":
        return cls(setting.host, setting.receivers)

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> dict:
        import torch.distributed as dist

        if self.store is None:
            self.store = dist.TCPStore(self.host, 0, self.size, is_master=True, wait_for_workers=False)
            threading.Thread(target=self._serve, daemon=True, name="weight-broadcast").start()
        self.queue.put(torch.from_numpy(np.concatenate(buffers)))
        return {"host": self.host, "port": self.store.port, "size": self.size}

    def _serve(self) -> None:
        group = gloo_group(self.store, 0, self.size, self.host, self.timeout)  # waits for every receiver to join
        while (flat := self.queue.get()) is not None:
            group.broadcast(flat, 0).wait()

    def close(self) -> None:
        self.queue.put(None)

    @classmethod
    def get(cls, bucket: Bucket, receiver: int = 0) -> list[np.ndarray]:
        import torch.distributed as dist
        from ray.util import get_node_ip_address

        key, size = (bucket.handle["host"], bucket.handle["port"]), bucket.handle["size"]
        if key not in cls._receiver_groups:
            store = dist.TCPStore(key[0], key[1], size, is_master=False, timeout=cls.timeout)
            cls._receiver_groups[key] = gloo_group(store, receiver + 1, size, get_node_ip_address(), cls.timeout)
        sizes = [spec.num_bytes for spec in bucket.specs]
        flat = torch.empty(sum(sizes), dtype=torch.uint8)
        cls._receiver_groups[key].broadcast(flat, 0).wait()
        return list(np.split(flat.numpy(), np.cumsum(sizes)[:-1]))


def gloo_group(store, rank: int, size: int, address: str, timeout: timedelta):
    """A gloo group whose sockets bind to `address`, this node's IP.

    Gloo's default device binds to whatever the host name resolves to, which is often 127.0.0.1
    (`/etc/hosts` in containers): peers on other hosts could then never connect.
    """
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=address)]
    return dist.ProcessGroupGloo(store, rank, size, options)
