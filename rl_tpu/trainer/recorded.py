"""The per-token figures of the rows the rollout record keeps (`TrainBatch.recorded`): the trainer's logprob of each
completion token, the one its logprob gap to the engine's (`actor/logprob_diff`) is taken from, and the policy's
entropy there, as the update's first epoch computed them. Kept on the device and read once, when the driver takes
them after the step (`take`): a step reads the device no more often for them (tests/unit/test_host_syncs.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from rl_tpu.records import TrainBatch


@dataclass
class RecordedRows:
    numbers: list[int] = field(default_factory=list)  # each kept row's `TrainBatch.recorded` number
    lengths: list[int] = field(default_factory=list)  # its completion's tokens
    parts: list[torch.Tensor] = field(default_factory=list)  # (2, tokens) each: logprobs, entropy; on the device

    def keep(self, micro: TrainBatch, logprobs: torch.Tensor, entropy: torch.Tensor) -> None:
        """The micro-batch's recorded rows, from its (rows, response length) logprobs and entropy."""
        if micro.recorded is None:
            return
        for i, number in enumerate(micro.recorded):
            if number >= 0:
                n = len(micro.completion_ids[i])
                self.numbers.append(number)
                self.lengths.append(n)
                self.parts.append(torch.stack([logprobs[i, :n], entropy[i, :n]]).detach().float())

    def take(self) -> dict[int, dict[str, list[float]]]:
        """{number: {"logprobs", "entropy"}} of every row kept since the last take, read in one copy; then empty."""
        if not self.parts:
            return {}
        flat = torch.cat(self.parts, dim=1).cpu().tolist()
        taken, start = {}, 0
        for number, n in zip(self.numbers, self.lengths):
            taken[number] = {"logprobs": flat[0][start : start + n], "entropy": flat[1][start : start + n]}
            start += n
        self.numbers, self.lengths, self.parts = [], [], []
        return taken
