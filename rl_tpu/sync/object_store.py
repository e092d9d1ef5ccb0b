"""`sync.transport=object_store`: buckets through Ray's object store; readers on the sender's node get zero-copy views."""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from rl_tpu.records import Bucket, WeightSyncError
from rl_tpu.sync.base import Transport


class ObjectStoreTransport(Transport):
    name = "object_store"
    any_rank_sends = True  # objects are fetched from whichever node put them
    rejoins_alone = through_host = True  # each engine fetches every bucket by its handle, when it installs

    def put(self, version: int, index: int, named: dict[str, torch.Tensor], buffers: list[np.ndarray]) -> Any:
        import ray

        return [ray.put(buffers)]  # freed by Ray's reference counting once the last bundle is dropped

    timeout_s = 300.0  # a bucket whose sender's node is gone must fail the install, not hang the engine

    @classmethod
    def get(cls, bucket: Bucket, receiver: int = 0) -> list[np.ndarray]:
        import ray
        from ray.exceptions import GetTimeoutError

        try:
            return ray.get(bucket.handle[0], timeout=cls.timeout_s)
        except GetTimeoutError as err:
            raise WeightSyncError(
                f"bucket {bucket.index} did not come through the object store within "
                f"{cls.timeout_s:g} s; nothing was installed"
            ) from err
