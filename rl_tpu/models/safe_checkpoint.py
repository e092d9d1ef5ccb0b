"""Checkpoints read as data: a checkpoint from someone else never runs their code.

torch.distributed.checkpoint (torch 2.13) reads a checkpoint's `.metadata` with a plain `pickle.load` and
its non-tensor items (optimizer param groups, scheduler state) with `torch.load(weights_only=False)`, and
offers no safe option for either. Here the metadata goes through an unpickler that admits only the
classes DCP itself writes there (found by listing a real checkpoint's globals), and the non-tensor items
through `torch.load(weights_only=True)`. Anything else is refused, naming the file and what it asked for,
before any of it runs. Tensors DCP already reads with `weights_only=True`.
"""

from __future__ import annotations

import io
import pickle
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

METADATA_CLASSES = {
    "torch.distributed.checkpoint.metadata": {
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorProperties",
        "TensorStorageMetadata",
        "BytesStorageMetadata",
        "ChunkStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    },
    "torch.distributed.checkpoint.filesystem": {"_StorageInfo"},
    "torch.serialization": {"_get_layout"},  # torch.layout's own pickling: a lookup by name
    "torch": {"Size"},
    "pathlib": {"PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"},  # the checkpoint id as saved
}


class UnsafeCheckpointError(ValueError):
    """A checkpoint file that would run code or build objects a checkpoint never holds."""


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        if name in METADATA_CLASSES.get(module, ()):
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)  # a dtype is pickled as the global torch.<dtype>
        raise UnsafeCheckpointError(
            f"{self.path}: refused: it asks for {module}.{name}, which a checkpoint's metadata never holds "
            "(loading it could run code); only checkpoints written by rl_tpu's trainer are read"
        )


class SafeReader(FileSystemReader):
    """A `FileSystemReader` whose `.metadata` is unpickled with an allowlist of DCP's own classes."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        path = Path(self.path) / ".metadata"
        try:
            with open(path, "rb") as file:
                metadata = _MetadataUnpickler(file, path).load()
        except UnsafeCheckpointError:
            raise
        except Exception as err:  # truncated, not a pickle, a class that does not exist
            raise UnsafeCheckpointError(f"{path}: not a readable checkpoint metadata file ({err})") from err
        if not isinstance(metadata, Metadata):
            raise UnsafeCheckpointError(f"{path}: holds a {type(metadata).__name__}, not a checkpoint's metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader fills it
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """Non-tensor items (param groups, scheduler state) with `torch.load(weights_only=True)`."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as err:
            # torch's message goes on to suggest weights_only=False: quote only what the item asked for
            asked = next((line for line in str(err).splitlines() if "Unsupported global" in line), type(err).__name__)
            asked = asked.split(" was not an allowed global")[0].strip().removeprefix("WeightsUnpickler error: ")
            raise UnsafeCheckpointError(
                f"checkpoint item {read_item.dest_index.fqn!r} refused: it is not plain data ({asked}); "
                "loading it could run code"
            ) from None
        super().load_bytes(read_item, _saved(loaded))


def _saved(value: Any) -> io.BytesIO:
    """The checked object, saved again for DCP's own `load_bytes`, which places it in the state dict: plain data
    that unpickles to itself, so DCP's unrestricted load of it is safe (placing it ourselves needs private API)."""
    buffer = io.BytesIO()
    torch.save(value, buffer)
    buffer.seek(0)
    return buffer


def load_state(state: dict, folder: str | Path, no_dist: bool = False) -> None:
    """`dcp.load` of `state` from `folder`, read as data; a refusal surfaces as `UnsafeCheckpointError`."""
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafeLoadPlanner(), no_dist=no_dist)
    except CheckpointException as failed:  # DCP gathers each rank's exception into one
        refused = [exc for exc, _ in failed.failures.values() if isinstance(exc, UnsafeCheckpointError)]
        if refused:
            raise refused[0] from None
        raise


def check_metadata(folder: str | Path) -> Metadata:
    """Read a checkpoint's metadata safely; raises `UnsafeCheckpointError` naming the file otherwise."""
    return SafeReader(str(folder)).read_metadata()
