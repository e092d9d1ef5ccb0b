"""The device layer: one object per process decides device type, distributed backend and compile backend.

Core code asks a `Device` instead of calling `torch.cuda.*` or `torch.tpu.*`. TorchTPU is only
imported when `device=tpu` is asked for, and never at import time of this module.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

_BACKENDS = {
    # kind: (distributed backend, torch.compile backend)
    "cpu": ("gloo", "inductor"),
    "cuda": ("nccl", "inductor"),
    "tpu": ("tpu_dist", "tpu"),
}


def _accelerator_kind() -> str | None:
    """The accelerator torch sees in this process (cuda, tpu, ...), without touching device APIs."""
    if not torch.accelerator.is_available():
        return None
    return torch.accelerator.current_accelerator().type


@dataclass(frozen=True)
class Device:
    kind: str  # "cpu" | "cuda" | "tpu"
    local_index: int = 0

    @classmethod
    def resolve(cls, requested: str, local_index: int = 0) -> "Device":
        """`auto` picks the accelerator that is present, else the CPU; a named kind must be present."""
        if requested not in ("auto", *_BACKENDS):
            raise ValueError(f"device={requested!r}: allowed values are auto, {', '.join(_BACKENDS)}")
        present = _accelerator_kind()
        if requested == "auto":
            return cls(present if present in _BACKENDS else "cpu", local_index)
        if requested == "tpu":
            _import_torch_tpu()
            present = _accelerator_kind()
        if requested != "cpu" and present != requested:
            raise RuntimeError(f"device={requested} was asked for but this process sees {present or 'no accelerator'}")
        return cls(requested, local_index)

    @property
    def torch_device(self) -> torch.device:
        return torch.device("cpu") if self.kind == "cpu" else torch.device(self.kind, self.local_index)

    @property
    def dist_backend(self) -> str:
        return _BACKENDS[self.kind][0]

    @property
    def compile_backend(self) -> str:
        return _BACKENDS[self.kind][1]

    def synchronize(self) -> None:
        if self.kind != "cpu":
            torch.accelerator.synchronize()

    def select(self) -> None:
        """Make this the process's current device: collectives and the device mesh use the current one."""
        if self.kind == "cuda":
            torch.cuda.set_device(self.local_index)

    def total_memory(self) -> int | None:
        """The device's memory in bytes (CUDA: read from its properties, nothing allocated); None where unknown."""
        if self.kind == "cuda":
            return torch.cuda.get_device_properties(self.local_index).total_memory
        return None

    def release_cached_memory(self) -> None:
        """Hand the memory the caching allocator keeps back to the device (for an engine that shares it)."""
        if self.kind == "cuda":
            torch.cuda.empty_cache()

    def new_stream(self) -> Any:
        """A stream of its own on this device (CUDA), for work that must not hold up the work queued on the default
        stream (a broadcast to a peer that may be dead); None where work runs as it is called (CPU)."""
        return torch.cuda.Stream(self.local_index) if self.kind == "cuda" else None

    def on_stream(self, stream: Any, after: Any = None) -> ContextManager:
        """Make `stream` (`new_stream`'s) this thread's current stream, its work queued after the event `after`
        (`mark`'s, from another thread: what the work reads was made there)."""
        if stream is None:
            return contextlib.nullcontext()
        if after is not None:
            stream.wait_event(after)
        return torch.cuda.stream(stream)

    def mark(self) -> Any:
        """An event on this thread's current stream, done once the work queued before it is; None where work is
        done as it is called (CPU)."""
        if self.kind != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    @staticmethod
    def wait_for(event: Any, deadline: float, poll_s: float = 0.01) -> bool:
        """Whether `event` (`mark`'s) is done by `deadline` (time.monotonic()): polled, never a blocking wait on the
        device, which work that never completes (a broadcast to a dead peer) would hold forever."""
        while event is not None and not event.query():
            if time.monotonic() >= deadline:
                return False
            time.sleep(poll_s)
        return True


def _import_torch_tpu() -> None:
    try:
        import torch_tpu  # noqa: F401  (registers the "tpu" device and the tpu_dist backend)
    except ImportError as err:
        raise RuntimeError("device=tpu needs the torch-tpu package on a TPU host (see examples/tpu/README.md)") from err
