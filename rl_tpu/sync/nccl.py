"""`sync.transport=nccl`: trainer rank 0 broadcasts each bundle's device buckets to every engine over NCCL, through
vLLM 0.32's weight-transfer API, for engines on GPUs of their own (disaggregated). WRITTEN TO VLLM'S API, NOT YET RUN
ON A GPU: its logic runs on the CPU with a gloo group in NCCL's place (`tests/unit/test_nccl_transport.py`).

Sender. Rank 0 sends: the trainer gathers every full bucket there, and vLLM's dense NCCL backend has one sender, its
rank 0. A bucket is one flat byte tensor on rank 0's GPU with its device checksum (`bundle.device_checksum`, as for
`cuda_ipc`). `flush` hands the bundle to a sender thread that drives vLLM's trainer engine
(`vllm.distributed.weight_transfer.nccl_engine.NCCLTrainerWeightTransferEngine`): `trainer_init` at the first bundle,
then `send_weights` per bundle, its `WeightSource` one uint8 tensor per bucket, unpacked (a bucket is packed already,
so it goes out as it lies). Publishing does not wait for the engines; the next bundle's first bucket waits for the
previous bundle's delivery, so that rank 0 keeps one bundle on its GPU.

Group. vLLM's TCP rendezvous (`NCCLTrainerInitInfo`): rank 0's node address, a free port, and a world size of one
plus the engines' ranks, one rank per engine here (the engines run without tensor parallelism). A bucket's handle is
the init info vLLM's `trainer_init` gives the workers (`NCCLWeightTransferInitInfo`, rank_offset 1); engine i joins
at its first bundle with rank_offset 1 + i, through `LLM.init_weight_transfer_engine`, into the
`NCCLWeightTransferEngine` its worker made from `weight_transfer_config` (`NcclTransport.engine_args`; `attach_engine`).

Receiver. The contract of every transport: the bundle (version, specs, device checksums) reaches each engine
through Ray, and the engine reads every bucket (refused or not: the stream stays aligned), checks every checksum on
its GPU, then the version and the names, and only then loads. vLLM's `LLM.start_weight_update`, `update_weights` and
`finish_weight_update` would load each bucket into the model as it arrives, before any check; so a bucket goes
through the worker's engine's own `update_weights` with the engine's target set to a holder that keeps the bytes
(`set_weight_update_target`). Loading them, and the prefix cache reset after, are the engine's as for every
transport. vLLM's trainer engine drives the engines through a client; here Ray does, so the client does nothing.

A dead peer. An NCCL broadcast has no deadline, and on a GPU it is only enqueued: vLLM's `broadcast` returns at
once, and a broadcast to a dead peer never completes. So the sender thread broadcasts on a stream of its own (a
stuck broadcast on the default stream would hold up every kernel the trainer queues after it, the trainer's next
step stalling in its first wait on the device), after an event marking the buckets gathered, and marks the
broadcasts' end with an event. Rank 0 waits up to `timeout` from the flush for the send to return and then for that
event (polled: `Device.wait_for`), then aborts the group and raises, naming the engines it waited for and where the
group met. The abort is vLLM's: its trainer engine's `shutdown` destroys its PyNcclCommunicator, which calls
`ncclCommAbort` (in a thread it waits 5 s for), so the broadcast still waiting returns; a rendezvous still waiting
ends at vLLM's store timeout. An engine's wait is bounded by the controller's deadline on the call, which names the
engine. The group cannot take a restarted engine back: a lost engine ends the run, as with `collective`. Rank 0
keeps the bundle in flight (its buckets are read by the broadcast until the event) and no other.
"""

from __future__ import annotations

import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as DeadlinePassed
from dataclasses import dataclass
from datetime import timedelta
from functools import cached_property
from typing import TYPE_CHECKING, Any, Iterator

import torch
from vllm.distributed.weight_transfer.base import ParamMeta, WeightSource, WeightTransferInitRequest
from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo, worker_init_payload
from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo, NCCLTrainerWeightTransferEngine
from vllm.utils.network_utils import get_open_port

from rl_tpu.records import Bucket, WeightSyncError
from rl_tpu.sync.base import Placed, SenderSetting, Transport

if TYPE_CHECKING:
    from rl_tpu.config import RunConfig


def bucket_name(index: int) -> str:
    """What a bucket is called on the wire (vLLM names what it sends; only the order matters to the receiver)."""
    return f"bucket {index}"


class BundleSource(WeightSource):
    """One bundle's buckets as vLLM's trainer engine sends them: a flat uint8 tensor each, in bucket order."""

    def __init__(self, version: int, flats: list[torch.Tensor]):
        self.version, self.flats = version, flats

    def metadata(self) -> list[ParamMeta]:
        return [ParamMeta(bucket_name(i), torch.uint8, (flat.numel(),)) for i, flat in enumerate(self.flats)]

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        return ((bucket_name(i), flat) for i, flat in enumerate(self.flats))


class EnginesDriveTheirSide:
    """vLLM's client of the engines' weight-sync calls, doing nothing: each engine joins the group and receives its
    buckets when Ray brings it the bundle (the sampler's install call)."""

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        pass

    def start_weight_update(self) -> None:
        pass

    def update_weights(self, update_info: dict[str, Any] | list[dict[str, Any]]) -> None:
        pass

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        pass


def require_wire(communicator: Any, where: str) -> None:
    """vLLM's NCCL communicator makes itself a no-op without an NCCL library: fail rather than move nothing."""
    if communicator is None or communicator.disabled:
        raise WeightSyncError(
            f"sync.transport=nccl: vLLM's NCCL communicator is disabled on {where} (no NCCL library found, or "
            "VLLM_DISABLE_PYNCCL set); use sync.transport=object_store or collective"
        )


class NcclTransport(Transport):
    """Sender side (trainer rank 0); `get_flat` and `attach_engine` are the receiver's side, in the sampler."""

    name = "nccl"
    on_device = True
    copies = True  # each engine receives every bucket into a buffer of its own
    devices = ("cuda",)
    timeout = timedelta(minutes=5)  # for a bundle to reach every engine, counted from its flush
    _engines: dict[int, "_Engine"] = {}  # receiver index -> its vLLM engine, in the sampler's process

    def __init__(self, host: str, receivers: int, device: Any):
        # `host`: the sender's node address, where the engines meet it; `device`: rank 0's `cluster.device.Device`
        # (its streams and events: the only place that calls torch.cuda, a layer above this one)
        if device is None:
            raise ValueError("sync.transport=nccl: the transport needs trainer rank 0's Device")
        self.host, self.receivers, self.device = host, receivers, device
        self.engine: NCCLTrainerWeightTransferEngine | None = None  # vLLM's, once the group is formed
        self.sender = ThreadPoolExecutor(1, thread_name_prefix="nccl-weight-send")
        self.version, self.flats = 0, []  # the bundle being put
        # the bundle in flight: its version, deadline, send (done: an event marking its broadcasts' end) and source
        self.sending: tuple[int, float, Future, BundleSource] | None = None
        self.stream: Any = None  # the sender thread's own stream on rank 0's device, made at the first send

    @classmethod
    def sender(cls, setting: SenderSetting) -> "NcclTransport":
        return cls(setting.host, setting.receivers, setting.device)

    @classmethod
    def check_config(cls, cfg: "RunConfig") -> None:
        """CUDA, and engines on GPUs of their own (any number of them), one NCCL rank per GPU. Only an explicit
        placement=colocated is seen here: auto resolves when actors are placed (`check_placement`)."""
        from rl_tpu.sync.registry import CPU_TRANSPORTS

        device, layout = cfg.device, cfg.placement
        if device not in ("cpu", "tpu") and layout != "colocated":
            return
        # what works there: the host transports, and TPU Sync on TPU or, colocated on CUDA with one engine, CUDA IPC
        own = {"tpu": ("tpu_sync",), "cpu": ()}.get(device, ("cuda_ipc",) if cfg.sampler.num_engines == 1 else ())
        raise ValueError(
            f"sync.transport=nccl broadcasts weights over NCCL from trainer rank 0's GPU to engines on GPUs of their "
            f"own: it needs device=cuda (or auto on a GPU host) and placement=disaggregated or auto (got "
            f"device={device}, placement={layout}); allowed values of sync.transport here: "
            f"{', '.join((*CPU_TRANSPORTS, *own))}"
        )

    @classmethod
    def check_placement(cls, cfg: "RunConfig", placed: Placed) -> str | None:
        """One NCCL group cannot hold two ranks on one GPU: engines that sleep are colocated on CUDA."""
        if not placed.engines_sleep:
            return None
        return (
            "sync.transport=nccl joins trainer rank 0 and the engines in one NCCL group, which cannot hold two ranks "
            f"on one GPU, but this run's layout is {placed.layout}, colocated: use sync.transport=cuda_ipc "
            "(one engine) or object_store, or placement=disaggregated with GPUs for both"
        )

    @classmethod
    def engine_args(cls) -> dict[str, Any]:
        """The engine's worker makes vLLM's NCCL weight-transfer engine, which `get_flat` receives through."""
        return {"weight_transfer_config": WEIGHT_TRANSFER_CONFIG}

    @classmethod
    def attach_engine(cls, receiver: int, llm: Any) -> None:
        """The engine whose worker receives this process's buckets; it joins the trainer's group at its first
        bundle."""
        cls._engines[receiver] = _Engine(llm)

    @cached_property
    def init_info(self) -> NCCLTrainerInitInfo:
        """The group's rendezvous, chosen at the first bucket: this node's address and a free port."""
        return NCCLTrainerInitInfo(
            master_address=self.host, master_port=get_open_port(), world_size=1 + self.receivers, packed=False, rank=0
        )

    @cached_property
    def handle(self) -> dict[str, Any]:
        """What vLLM's `trainer_init` gives the workers (rank_offset 1: after the trainer's rank 0); engines join
        with it."""
        i = self.init_info
        workers = NCCLWeightTransferInitInfo(
            master_address=i.master_address,
            master_port=i.master_port,
            rank_offset=1,
            world_size=i.world_size,
            packed=i.packed,
        )
        return worker_init_payload(workers)

    def put_flat(self, version: int, index: int, flat: torch.Tensor) -> dict[str, Any]:
        if index == 0:
            self._wait_delivered()
            self.version = version
        self.flats.append(flat)
        return self.handle

    def flush(self) -> None:
        source, self.flats = BundleSource(self.version, self.flats), []
        deadline = time.monotonic() + self.timeout.total_seconds()
        gathered = self.device.mark()  # on this thread's stream, where the buckets were made
        self.sending = (source.version, deadline, self.sender.submit(self._send, source, gathered), source)

    def _send(self, source: BundleSource, gathered: Any) -> Any:
        """On the sender thread, on its own stream after `gathered`: the group formed at the first bundle (it waits
        for every engine), then the bundle. Returns an event that is done once the broadcasts are."""
        self.device.select()  # a new thread starts on GPU 0; vLLM opens its endpoint on the current GPU
        if self.stream is None:
            self.stream = self.device.new_stream()
        with self.device.on_stream(self.stream, after=gathered):
            if self.engine is None:
                self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
                    self.init_info, client=EnginesDriveTheirSide(), source=source
                )
                require_wire(self.engine.model_update_group, "trainer rank 0")
            self.engine.source = source
            try:
                self.engine.send_weights()
            finally:
                self.engine.source = None  # held in `sending` until delivered, then freed
            return self.device.mark()

    def _wait_delivered(self) -> None:
        """Wait for the bundle in flight to reach every engine: its send to return, then its broadcasts' event;
        past its deadline abort the group and name the engines."""
        if self.sending is None:
            return
        (version, deadline, send, _), self.sending = self.sending, None  # its buckets are freed on return
        try:
            broadcasts = send.result(timeout=max(0.0, deadline - time.monotonic()))
        except DeadlinePassed:
            raise self._abort(version) from None
        except Exception as err:
            raise WeightSyncError(f"sync.transport=nccl: sending weights v{version} failed: {err}") from err
        if not self.device.wait_for(broadcasts, deadline):
            raise self._abort(version)

    def _abort(self, version: int) -> WeightSyncError:
        """Abort the group (vLLM's `shutdown`: ncclCommAbort, so a broadcast still waiting returns); the error."""
        if self.engine is not None:
            self.engine.shutdown()
        return WeightSyncError(
            f"sync.transport=nccl: weights v{version} did not reach engines {list(range(self.receivers))} "
            f"(group ranks 1-{self.receivers} at {self.host}:{self.init_info.master_port}) within "
            f"{self.timeout}: an engine died or did not take the bundle; the group is aborted"
        )

    def close(self) -> None:
        self.sender.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            self.engine.shutdown()

    @classmethod
    def get_flat(cls, bucket: Bucket, receiver: int = 0) -> torch.Tensor:
        engine = cls._engines.get(receiver)
        if engine is None:
            raise WeightSyncError(
                f"sync.transport=nccl: engine {receiver} has no vLLM weight-transfer engine in this process "
                "(the sampler attaches one when it starts with sync.transport=nccl)"
            )
        if not engine.joined:
            # workers follow the trainer's rank 0 and the engines before this one (one rank each)
            init_info = {**bucket.handle, "rank_offset": bucket.handle["rank_offset"] + receiver}
            engine.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info=init_info))
            engine.joined = True
        size = sum(spec.num_bytes for spec in bucket.specs)
        update = {"names": [bucket_name(bucket.index)], "dtype_names": ["uint8"], "shapes": [[size]]}
        return engine.llm.collective_rpc(receive_bucket, args=(update,))[0]


@dataclass
class _Engine:
    llm: Any  # vLLM's LLM
    joined: bool = False  # whether it joined the trainer's group


WEIGHT_TRANSFER_CONFIG = {"backend": "nccl"}  # vLLM's `weight_transfer_config` of an engine that receives over NCCL


class _Holder:
    """The target of vLLM's receive path in place of the model: keeps the bucket's bytes instead of loading them."""

    flat: torch.Tensor | None = None

    def load_weights(self, weights: list[tuple[str, torch.Tensor]]) -> None:
        ((_, self.flat),) = weights


def receive_bucket(worker: Any, update_info: dict[str, Any]) -> torch.Tensor:
    """Run inside the vLLM worker: one bucket through its NCCL weight-transfer engine, kept aside, not loaded."""
    engine = worker.weight_transfer_engine
    require_wire(engine.model_update_group, "this engine")
    holder = _Holder()
    engine.set_weight_update_target(holder, engine.model_config)
    try:
        engine.update_weights(update_info)  # vLLM's receive: a buffer of the bucket's size, broadcast from rank 0
    finally:
        engine.reset_weight_update_target()
    return holder.flat
