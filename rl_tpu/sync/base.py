"""The sender side's base class, which every transport implements; it imports nothing else of `rl_tpu.sync`."""

from __future__ import annotations


class Transport:
    """Sender side of a transport: `put` stages one bucket and returns its handle; `flush` ends a bundle.

    The receiver side is the class method `get(bucket, receiver) -> list of byte arrays`, one per
    spec; `receiver` is the engine's index among the engines that receive every bundle.
    """

    name: str
    # whether any trainer rank may stage buckets: the receiver then fetches each from where it was put
    any_rank_sends: bool = False
    # whether buckets stay on the device: `put_flat`/`get_flat` move one flat byte tensor each, checked with
    # `bundle.device_checksum` where it lies, instead of `put`/`get` moving host buffers checked with blake3
    on_device: bool = False
    # how many bundles a sending rank keeps at once: the last, or the one before too while an engine may still read it
    kept_versions: int = 1
    # whether `get_flat` gives the engine its own copy of a bucket on its device (received, not opened where it lies)
    copies: bool = False

    def prepare(self, bundle_bytes: int) -> None:
        """Called once on a sending rank, before the first bundle, with its size: a transport that keeps bundles
        checks its room here, at start, rather than failing at a step."""

    def flush(self) -> None:
        """Called after the last bucket of a bundle; transports that send per bucket have nothing left."""

    def close(self) -> None:
        """Release what the transport holds when the trainer shuts down."""
