"""A train step reads the device a fixed number of times, however many micro-batches it runs: each read (`.item()`,
`float()` of a tensor, a copy to the host) waits for the device to finish its queue, and on a GPU a read per
micro-batch stalls the kernels behind it. Counted on the CPU by the op every read of a scalar goes through."""

from __future__ import annotations

import traceback

import pytest
import torch
from conftest import free_port, make_batch
from torch.utils._python_dispatch import TorchDispatchMode

from rl_tpu.config import RunConfig
from rl_tpu.trainer.worker import TrainerWorker

# transformers' SDPA mask check reads whether the padding mask is all ones (`fast_all` in masking_utils), once
# or twice a forward, unless traced; it is the model library's, counted apart
MODEL_LIBRARY = "transformers/masking_utils.py"


class ScalarReads(TorchDispatchMode):
    """Counts reads of a tensor's value into Python (`aten._local_scalar_dense`), by who asked for them."""

    def __init__(self):
        super().__init__()
        self.ours, self.model_library = 0, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            stack = "".join(f.filename for f in traceback.extract_stack()[-12:])
            if MODEL_LIBRARY in stack:
                self.model_library += 1
            else:
                self.ours += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("ppo_epochs", [1, 2])
def test_a_train_step_reads_the_device_once_an_update_however_many_micro_batches(tiny_model_dir, ppo_epochs):
    reads = {}
    for micro_batch_size in (1, 8):
        cfg = RunConfig()
        cfg.device, cfg.trainer.micro_batch_size = "cpu", micro_batch_size
        cfg.trainer.skip_zero_advantage_rows = False  # every row runs: 8 micro-batches against 1
        cfg.actor.ppo_epochs = ppo_epochs  # an update an epoch
        worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
        try:
            with ScalarReads() as counted:
                metrics = worker.train_step(make_batch(seed=3, size=8))
        finally:
            worker.shutdown()
        reads[micro_batch_size] = counted
        assert metrics["actor/updates"] == ppo_epochs
        assert counted.ours == ppo_epochs  # the gradient norm, to apply the update or not; the figures come at the end
    assert reads[1].ours == reads[8].ours
    # the model library's own: at most two a forward, so it does grow with the micro-batches
    forwards = 8 * (ppo_epochs + (ppo_epochs > 1))  # with several updates, the old policy's forward too
    assert 0 < reads[8].model_library < reads[1].model_library <= 2 * forwards
