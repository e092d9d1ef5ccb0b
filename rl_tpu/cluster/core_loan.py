"""An idle engine's cores lent to the trainer, on CPU hosts where the actors are pinned.

Pinned (rl_tpu/cluster/cores.py), a trainer rank and an engine each compute on cores of their own.
In async mode the engine generates its batch in part of a step and then waits for the next
weights, while the trainer, the slower side, still computes on its own cores. With a loan
(`trainer.borrow_idle_cores`) a rank widens its thread pool onto its node's engine cores while
every engine there is idle, and narrows back as soon as one of them takes a call.

Each engine marks a one-byte file in a node-local folder (tmpfs) busy or idle; the rank reads
the files before every decoder block's forward and backward, where the thread count can
change between operations. A read costs microseconds; a Ray call or object costs
milliseconds, and would need the engine's attention while it generates.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import threading
import time
from pathlib import Path

import torch
from torch import nn

from rl_tpu.cluster.cores import CpuBinding, pin_threads
from rl_tpu.models.families import decoder_layers

BUSY, IDLE = b"1", b"0"


def activity_root() -> Path:
    """Where this node keeps the activity files: shared memory where there is one, so reads stay in memory."""
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def activity_file(folder: str, engine: int) -> Path:
    return activity_root() / folder / f"engine-{engine}"


class EngineActivity:
    """The engine's side: its file reads busy while any of its calls runs (generations and installs run on two
    threads, so calls are counted). `folder` None: no rank borrows this engine's cores, nothing is written."""

    def __init__(self, folder: str | None, engine: int):
        self._calls, self._lock, self._fd = 0, threading.Lock(), None
        if folder:
            self.path = activity_file(folder, engine)
            self.path.parent.mkdir(mode=0o700, exist_ok=True)
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            os.pwrite(self._fd, IDLE, 0)

    def __enter__(self) -> None:
        with self._lock:
            self._calls += 1
            if self._calls == 1 and self._fd is not None:
                os.pwrite(self._fd, BUSY, 0)

    def __exit__(self, *exc) -> None:
        with self._lock:
            self._calls -= 1
            if self._calls == 0 and self._fd is not None:
                os.pwrite(self._fd, IDLE, 0)

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
            self.path.unlink(missing_ok=True)
            with contextlib.suppress(OSError):  # the last engine of the node removes the folder
                self.path.parent.rmdir()


class Borrower:
    """A trainer rank's side: computes on `binding.loan`'s cores too while every engine it watches is idle.

    Without a loan every method does nothing, so the trainer calls them unconditionally."""

    def __init__(self, binding: CpuBinding, node_cpus: list[int]):
        """`node_cpus`: what `binding.apply` returned, the list its core positions index."""
        self.binding, self.loan = binding, binding.loan
        self.wide, self._wide_since, self.wide_s = False, 0.0, 0.0
        if self.loan:
            self._narrow_cpus = binding.cpus(node_cpus)
            self._wide_cpus = self._narrow_cpus | binding.cpus(node_cpus, self.loan.cores)
            self._files = [activity_file(self.loan.folder, e) for e in self.loan.engines]

    def engines_idle(self) -> bool:
        """Whether every watched engine's file reads idle (one not started yet counts as busy)."""
        try:
            return all(f.read_bytes() == IDLE for f in self._files)
        except OSError:
            return False

    def poll(self) -> None:
        if self.loan and self.engines_idle() != self.wide:
            self._switch(not self.wide)

    def _switch(self, wide: bool) -> None:
        self._count_wide_time()
        self.wide = wide
        # the wider mask first, so the threads a larger pool starts inherit it
        pin_threads(self._wide_cpus if wide else self._narrow_cpus)
        torch.set_num_threads(len(self._wide_cpus) if wide else self.binding.threads)

    def _count_wide_time(self) -> None:
        now = time.perf_counter()
        if self.wide:
            self.wide_s += now - self._wide_since
        self._wide_since = now

    def take_wide_seconds(self) -> float:
        """Seconds spent widened since the last call (a step's share)."""
        self._count_wide_time()
        seconds, self.wide_s = self.wide_s, 0.0
        return seconds

    def attach(self, model: nn.Module) -> None:
        """Poll before each decoder block's forward, and after each block's backward (its input's gradient)."""
        if not self.loan:
            return
        # Compiled blocks (`trainer.compile`): Inductor fixes a kernel's thread count when it compiles it unless
        # told to read it when the kernel runs. Dynamo compiles each block once per thread count (it guards on
        # it), but a backward is compiled at its first run, maybe at the other width: two threads on one core.
        import torch._inductor.config  # here: a second to import, and only a borrowing rank needs it

        torch._inductor.config.cpp.dynamic_threads = True

        @torch.compiler.disable  # Python between the compiled blocks, never traced into them
        def before_block(_module, args) -> None:
            self.poll()
            hidden = args[0] if args else None
            if isinstance(hidden, torch.Tensor) and hidden.requires_grad and torch.is_grad_enabled():
                hidden.register_hook(self._after_block_backward)

        for layer in decoder_layers(model):
            layer.register_forward_pre_hook(before_block)

    def _after_block_backward(self, grad: torch.Tensor) -> None:
        self.poll()
