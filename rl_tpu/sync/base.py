"""The sender side's base class, which every transport implements, with its facts and the hooks the controller,
the trainer and the sampler call; it imports nothing else of `rl_tpu.sync`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rl_tpu.config import RunConfig

DEVICE_KINDS = ("cpu", "cuda", "tpu")


@dataclass(frozen=True)
class Placed:
    """Where a run's actors were placed, as a transport's `check_placement` reads it (the controller fills it in)."""

    layout: str  # colocated or disaggregated
    engines_sleep: bool  # colocated on CUDA: each engine gives its device to the trainer between installs
    engines_away: tuple[int, ...]  # the engines placed on another node than trainer rank 0


@dataclass(frozen=True)
class SenderSetting:
    """What a sending rank knows when it makes its transport (`Transport.sender`)."""

    shm_dir: str = "/dev/shm/rl_tpu"  # sync.shm_dir
    host: str = "127.0.0.1"  # the sender's node address, where engines on other nodes reach it
    receivers: int = 1  # the engines, each receiving every bundle
    device: Any = None  # the sending rank's `cluster.device.Device` (a device transport waits on its events)


class Transport:
    """Sender side of a transport: `put` stages one bucket and returns its handle; `flush` ends a bundle.

    The receiver side is the class method `get(bucket, receiver) -> list of byte arrays`, one per
    spec; `receiver` is the engine's index among the engines that receive every bundle.

    The class also states its facts and answers the run's questions about it, so that no other part of rl_tpu
    branches on a transport's name: the checks before Ray starts (`check_config`) and once the device kind and
    placement are known (`check_device`, `check_placement`), the engine's own settings (`engine_args`,
    `attach_engine`) and a start-up handshake the controller runs when `handshake` is set (`offer`, `listen`,
    `connect`).
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
    # the device kinds it runs on
    devices: tuple[str, ...] = DEVICE_KINDS
    # whether an engine restarted in place can take the next bundle alone: each install is a call of its own, not a
    # stream or group that every engine joins (`sampler.max_restarts`)
    rejoins_alone: bool = False
    # whether every process of an engine can read its buckets on the host: an engine over several devices
    # (`sampler.tensor_parallel_size`) can then receive through it
    through_host: bool = False
    # whether the controller runs `offer`, `listen` and `connect` once at start-up, after every actor started
    handshake: bool = False

    @classmethod
    def sender(cls, setting: SenderSetting) -> "Transport":
        """The sender side on a trainer rank; a transport that needs part of `setting` takes it here."""
        return cls()

    @classmethod
    def check_config(cls, cfg: "RunConfig") -> None:
        """Before Ray starts: refuse settings this transport cannot serve with a ValueError naming the keys."""

    @classmethod
    def check_device(cls, cfg: "RunConfig", kind: str) -> None:
        """Once the run's device kind is known (`device=auto` resolved): refuse one the transport does not run on."""
        if kind not in cls.devices:
            raise ValueError(
                f"sync.transport={cfg.sync.transport} runs on {', '.join(cls.devices)} only, but this run is on "
                f"{kind}: use object_store, shm_file or collective"
            )

    @classmethod
    def check_placement(cls, cfg: "RunConfig", placed: Placed) -> str | None:
        """Once the actors are placed, before they start: why this placement cannot work (None: it can)."""
        return None

    @classmethod
    def engine_args(cls) -> dict[str, Any]:
        """vLLM's settings an engine that receives through this transport needs."""
        return {}

    @classmethod
    def attach_engine(cls, receiver: int, llm: Any) -> None:
        """In an engine's process once its vLLM `LLM` is made: what the receiving side needs of it."""

    def offer(self, specs: dict[str, Any], bucket_bytes: int) -> Any:
        """Handshake, trainer rank 0: what every engine listens for (`specs`: the served weights' meta tensors)."""
        raise NotImplementedError(f"sync.transport={self.name} sets handshake but has no offer()")

    @classmethod
    def listen(cls, offer: Any, receiver: int, device: Any, host: str) -> Any:
        """Handshake, engine `receiver` (on torch `device`, at node address `host`): open the receiving side for
        `offer`; returns what rank 0 connects to."""
        raise NotImplementedError(f"{cls.__name__} sets handshake but has no listen()")

    def connect(self, offer: Any, answers: list[Any], device: Any) -> None:
        """Handshake, trainer rank 0: connect to every engine's answer (in engine order), on torch `device`."""
        raise NotImplementedError(f"sync.transport={self.name} sets handshake but has no connect()")

    def prepare(self, bundle_bytes: int) -> None:
        """Called once on a sending rank, before the first bundle, with its size: a transport that keeps bundles
        checks its room here, at start, rather than failing at a step."""

    def flush(self) -> None:
        """Called after the last bucket of a bundle; transports that send per bucket have nothing left."""

    def close(self) -> None:
        """Release what the transport holds when the trainer shuts down."""
