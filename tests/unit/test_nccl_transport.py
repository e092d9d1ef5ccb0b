"""`sync.transport=nccl`'s logic, run on the CPU. vLLM's own weight-transfer engines move real bundles: its trainer
engine (`NCCLTrainerWeightTransferEngine`) on the transport's sender thread as trainer rank 0, its worker engine
(`NCCLWeightTransferEngine`) under each sampler's install, on threads of this process; vLLM forms the group from the
transport's rendezvous and ranks. Three stand-ins: a gloo group of the same ranks in place of vLLM's NCCL communicator
(made where vLLM makes it, `nccl_common.stateless_init_process_group`), an in-process engine in place of vLLM's
LLM and worker, and rank 0's Device with events that stay pending while a broadcast to a dead engine is, as on a GPU. The CUDA calls vLLM makes around its communicator (the current stream and device, a synchronize) are
stubbed: nothing here ran on a GPU, and the NCCL path itself has not run yet."""

from __future__ import annotations

import functools
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
from conftest import compose_run
from vllm.config.weight_transfer import WeightTransferConfig
from vllm.distributed.weight_transfer import nccl_common
from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferEngine

from rl_tpu.cluster.core_loan import EngineActivity
from rl_tpu.cluster.device import Device
from rl_tpu.config import register_configs
from rl_tpu.controller.checks import validate
from rl_tpu.models.families import FAMILIES
from rl_tpu.records import WeightBundle, WeightSyncError
from rl_tpu.sampler.engine import EngineOptions, EngineTurns, Sampler
from rl_tpu.sampler.served import FullWeights
from rl_tpu.sync.collective import gloo_group
from rl_tpu.sync.endpoints import pack_buckets
from rl_tpu.sync.nccl import NcclTransport
from rl_tpu.sync.registry import make_transport
from rl_tpu.trainer import weights

register_configs()

WIRE_TIMEOUT = timedelta(seconds=60)  # a test that goes wrong fails instead of hanging
BUCKET_MB = 2048 / 2**20  # the embedding fills one bucket, the other weights share the second


class TiedModel(torch.nn.Module):
    """A causal LM's weights under Hugging Face names, its head tied to its embedding."""

    def __init__(self, seed: int):
        super().__init__()
        torch.manual_seed(seed)
        self.model = torch.nn.Module()
        self.model.embed_tokens = torch.nn.Embedding(64, 16)
        self.model.norm = torch.nn.LayerNorm(16)
        self.model.up_proj = torch.nn.Linear(16, 32, bias=False)
        self.lm_head = torch.nn.Linear(16, 64, bias=False)
        self.lm_head.weight = self.model.embed_tokens.weight


def served_bits(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every weight name (the tied head's too) -> the bits of its bf16 value, as an engine serves it."""
    return {
        n: p.detach().to(torch.bfloat16).view(torch.int16) for n, p in model.named_parameters(remove_duplicate=False)
    }


class GlooWire:
    """vLLM's PyNcclCommunicator as the weight transfer uses it, over a gloo group of the same ranks. It counts the
    bytes a rank receives, and flips a byte of the receives whose order is in `opened.damaged` (damage in flight).
    Once `opened.engines_dead`, the sender's broadcasts behave as NCCL's on a GPU with a dead peer: enqueued, they
    return at once and never complete (`opened.stuck` counts them)."""

    disabled = False

    def __init__(self, host: str, port: int, rank: int, world_size: int, opened: SimpleNamespace):
        store = dist.TCPStore(host, port, world_size, is_master=rank == 0, timeout=WIRE_TIMEOUT, wait_for_workers=False)
        self.group = gloo_group(store, rank, world_size, host, WIRE_TIMEOUT)
        self.rank, self.opened, self.received, self.received_bytes = rank, opened, 0, 0
        self.aborted = False

    def broadcast(self, tensor: torch.Tensor, src: int, stream=None) -> None:
        if self.rank == src and self.opened.engines_dead:
            self.opened.stuck += 1
            return
        self.group.broadcast(tensor, src).wait()
        if self.rank == src:
            return
        if self.received in self.opened.damaged:
            tensor[7] ^= 0xFF
        self.received, self.received_bytes = self.received + 1, self.received_bytes + tensor.numel()

    def destroy(self) -> None:  # vLLM's: ncclCommAbort
        self.aborted = True


class EnqueuingDevice(Device):
    """Rank 0's Device (the CPU's, no streams) with a GPU's events: `mark` gives an event that is done once the
    broadcasts enqueued before it are, never while one of them is stuck (`GlooWire`)."""

    opened: SimpleNamespace = SimpleNamespace(stuck=0)

    def mark(self) -> SimpleNamespace:
        stuck = self.opened.stuck
        return SimpleNamespace(query=lambda: stuck == 0)


@pytest.fixture
def wires(monkeypatch):
    """The communicators vLLM opens, by rank, as gloo wires; `wires.damaged`: receives to damage."""
    opened = SimpleNamespace(by_rank={}, damaged=set(), engines_dead=False, stuck=0)

    def open_wire(master_address, master_port, rank, world_size, device):
        opened.by_rank[rank] = GlooWire(master_address, master_port, rank, world_size, opened)
        return opened.by_rank[rank]

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", open_wire)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.accelerator, "current_device_index", lambda: 0)
    monkeypatch.setattr(torch.accelerator, "synchronize", lambda device=None: None)
    monkeypatch.setattr(NcclTransport, "_engines", {})
    monkeypatch.setattr(EnqueuingDevice, "opened", opened)
    return opened


@pytest.fixture
def transport():
    made = []

    def make(receivers: int) -> NcclTransport:
        made.append(make_transport("nccl", host="127.0.0.1", receivers=receivers, device=EnqueuingDevice("cpu")))
        return made[-1]

    yield make
    for sender in made:
        sender.close()


class InProcessEngine:
    """vLLM's LLM and its one worker, in this process as the sampler runs them: the served model (bf16, its head tied),
    a real `NCCLWeightTransferEngine`, and `reload_weights` copying by name (these weights are not fused)."""

    def __init__(self):
        self.model = TiedModel(seed=1).to(torch.bfloat16)
        self.model_runner = SimpleNamespace(model=self.model)
        one_rank = SimpleNamespace(data_parallel_index=0, world_size=1, rank=0)
        config = SimpleNamespace(parallel_config=one_rank, model_config=None)
        self.llm_engine = SimpleNamespace(vllm_config=config)  # what the sampler reads of its engine's layout
        self.weight_transfer_engine = NCCLWeightTransferEngine(
            WeightTransferConfig(backend="nccl"), config, torch.device("cpu"), self.model
        )
        self.prefix_cache_resets = 0

    def collective_rpc(self, method, args=(), kwargs=None) -> list:
        call = getattr(self, method) if isinstance(method, str) else functools.partial(method, self)
        return [call(*args, **(kwargs or {}))]

    def init_weight_transfer_engine(self, request) -> None:  # LLM's, as its worker runs it
        engine = self.weight_transfer_engine
        engine.init_transfer_engine(engine.parse_init_info(request.init_info))

    def reload_weights(self, weights_iterator) -> None:
        params = dict(self.model.named_parameters(remove_duplicate=False))
        with torch.no_grad():
            for name, tensor in weights_iterator:
                params[name].copy_(tensor)

    def reset_prefix_cache(self) -> None:
        self.prefix_cache_resets += 1


def sampler(engine: InProcessEngine, index: int) -> Sampler:
    """The sampler's install path around `engine`, set up as `Sampler.__init__` does with sync.transport=nccl."""
    started = object.__new__(Sampler)  # vLLM's start-up left out: `engine` stands in for it
    started.options, started.llm = EngineOptions(index=index, transport="nccl"), engine
    started.version, started.busy_s, started.turns = 0, 0.0, EngineTurns()
    started.activity = EngineActivity(None, index)
    started.served = FullWeights(engine, FAMILIES["qwen3"].fused_weights)  # served_weights without a model folder
    NcclTransport.attach_engine(index, engine)
    return started


def publish(sender: NcclTransport, model: TiedModel, version: int, leave_out: tuple[str, ...] = ()) -> WeightBundle:
    """Trainer rank 0's publish (`TrainerWorker.publish_weights`): the served weights, a tied head once, in bf16."""
    params = {name: p for name, p in weights.served_params(model).items() if name not in leave_out}
    return pack_buckets(weights.served_buckets(params, torch.bfloat16, BUCKET_MB, rank=0), version, sender)


def install(samplers: list[Sampler], bundle: WeightBundle) -> list:
    """Every engine's install at once, as the pool sends them: each one's answer, or what it raised."""
    with ThreadPoolExecutor(len(samplers)) as pool:
        calls = [pool.submit(s.install, bundle) for s in samplers]
        return [call.exception() or call.result() for call in calls]


def test_bundles_reach_every_engine_bit_for_bit_and_reset_the_prefix_cache(wires, transport):
    sender, engines = transport(2), [InProcessEngine(), InProcessEngine()]
    samplers = [sampler(engine, i) for i, engine in enumerate(engines)]
    for version, trainer in enumerate((TiedModel(seed=0), TiedModel(seed=2)), start=1):
        bundle = publish(sender, trainer, version)
        assert bundle.transport == "nccl" and len(bundle.buckets) == 2
        assert [answer["version"] for answer in install(samplers, bundle)] == [version, version]
        for engine in engines:
            got = served_bits(engine.model)
            assert all(torch.equal(got[name], bits) for name, bits in served_bits(trainer).items())
            assert engine.prefix_cache_resets == version
    assert sorted(wires.by_rank) == [0, 1, 2]  # one group: trainer rank 0, then engine i at rank 1 + i


def test_the_tied_head_crosses_once(wires, transport):
    sender, engine = transport(1), InProcessEngine()
    trainer = TiedModel(seed=0)
    bundle = publish(sender, trainer, 1)
    assert "lm_head.weight" not in bundle.names and "model.embed_tokens.weight" in bundle.names
    [answer] = install([sampler(engine, 0)], bundle)
    once = sum(p.numel() for p in trainer.parameters()) * 2  # bf16; parameters() lists a shared weight once
    assert bundle.num_bytes == once == wires.by_rank[1].received_bytes
    assert answer["version"] == 1
    assert torch.equal(served_bits(engine.model)["lm_head.weight"], served_bits(trainer)["lm_head.weight"])


def refused(samplers: list[Sampler], bundle: WeightBundle, message: str) -> None:
    """The bundle is refused, the engine keeps serving what it had, and the next bundle installs: the stream of
    buckets stayed aligned, since an engine reads every bucket whether it installs them or not."""
    engine = samplers[0].llm
    before, version, resets = served_bits(engine.model), samplers[0].version, engine.prefix_cache_resets
    [error] = install(samplers, bundle)
    assert isinstance(error, WeightSyncError), error
    assert message in str(error)
    assert all(torch.equal(bits, before[name]) for name, bits in served_bits(engine.model).items())
    assert (samplers[0].version, engine.prefix_cache_resets) == (version, resets)


def test_a_stale_bundle_is_refused(wires, transport):
    sender, samplers = transport(1), [sampler(InProcessEngine(), 0)]
    install(samplers, publish(sender, TiedModel(seed=0), 2))
    refused(samplers, publish(sender, TiedModel(seed=3), 2), "sampler serves v2; refusing older or equal bundle v2")
    assert install(samplers, publish(sender, TiedModel(seed=4), 3))[0]["version"] == 3


def test_a_bucket_damaged_in_flight_fails_its_checksum_and_nothing_is_installed(wires, transport):
    sender, samplers = transport(1), [sampler(InProcessEngine(), 0)]
    wires.damaged.add(1)  # the engine's second receive: bucket 1 of the first bundle
    bundle = publish(sender, TiedModel(seed=0), 1)
    refused(samplers, bundle, "weight bundle v1: bucket 1 of 2 fails its checksum (nccl); nothing was installed")
    assert install(samplers, publish(sender, TiedModel(seed=0), 2))[0]["version"] == 2


def test_a_bundle_missing_a_weight_is_refused(wires, transport):
    sender, samplers = transport(1), [sampler(InProcessEngine(), 0)]
    bundle = publish(sender, TiedModel(seed=0), 1, leave_out=("model.norm.bias",))
    refused(samplers, bundle, "does not match the served model: missing ['model.norm.bias']")
    assert install(samplers, publish(sender, TiedModel(seed=0), 2))[0]["version"] == 2


def test_engines_that_never_join_are_named_after_the_deadline(wires, transport, monkeypatch):
    released = threading.Event()

    def never_joined(*args):  # the rendezvous waits for engines that never come, until the test ends
        released.wait()
        raise RuntimeError("the test is over")

    monkeypatch.setattr(nccl_common, "stateless_init_process_group", never_joined)
    sender = transport(2)
    sender.timeout = timedelta(seconds=0.1)
    publish(sender, TiedModel(seed=0), 1)
    try:
        with pytest.raises(WeightSyncError, match=r"weights v1 did not reach engines \[0, 1\] \(group ranks 1-2 at "):
            publish(sender, TiedModel(seed=0), 2)
    finally:
        released.set()


def test_a_broadcast_that_never_completes_aborts_the_group_at_the_deadline(wires, transport):
    """On a GPU vLLM's broadcast is only enqueued: the send returns while a dead engine's broadcast never completes.
    Rank 0 waits on the event after its broadcasts, not the send, and aborts the group past the deadline."""
    sender, samplers = transport(1), [sampler(InProcessEngine(), 0)]
    install(samplers, publish(sender, TiedModel(seed=0), 1))
    wires.engines_dead, sender.timeout = True, timedelta(seconds=0.2)
    publish(sender, TiedModel(seed=2), 2)  # publishing does not wait for the engines
    start = time.monotonic()
    with pytest.raises(
        WeightSyncError, match=r"weights v2 did not reach engines \[0\] \(group ranks 1-1 at .* aborted"
    ):
        publish(sender, TiedModel(seed=3), 3)
    assert wires.stuck == 2 and wires.by_rank[0].aborted  # both buckets enqueued; vLLM's shutdown aborted the group
    assert time.monotonic() - start < WIRE_TIMEOUT.total_seconds()  # at the deadline, not a wire's timeout


def test_an_event_is_polled_until_its_deadline():
    never, done = SimpleNamespace(query=lambda: False), SimpleNamespace(query=lambda: True)
    assert Device.wait_for(done, time.monotonic()) and Device.wait_for(None, time.monotonic())  # None: CPU work
    start = time.monotonic()
    assert not Device.wait_for(never, start + 0.05)
    assert time.monotonic() - start >= 0.05


def test_a_disabled_nccl_communicator_fails_the_send(wires, transport, monkeypatch):
    # vLLM's communicator makes itself a no-op where it finds no NCCL library
    disabled = SimpleNamespace(disabled=True, destroy=lambda: None)
    monkeypatch.setattr(nccl_common, "stateless_init_process_group", lambda *args: disabled)
    sender = transport(1)
    publish(sender, TiedModel(seed=0), 1)
    with pytest.raises(WeightSyncError, match="sending weights v1 failed: .* disabled on trainer rank 0"):
        publish(sender, TiedModel(seed=0), 2)


@pytest.mark.parametrize(
    "overrides, allowed",
    [
        (["device=cpu"], "object_store, shm_file, collective$"),
        (["device=tpu"], "object_store, shm_file, collective, tpu_sync$"),
        (
            ["device=cuda", "placement=colocated", "sampler.num_engines=1"],
            "object_store, shm_file, collective, cuda_ipc$",
        ),
    ],
)
def test_the_checks_refuse_nccl_without_gpus_of_the_engines_own(overrides, allowed):
    with pytest.raises(ValueError, match=f"sync.transport=nccl .* allowed values of sync.transport here: {allowed}"):
        validate(compose_run("sync.transport=nccl", *overrides))
    # CUDA, engines on GPUs of their own, any number of them (ray.address: no local GPU looked for here)
    validate(compose_run("sync.transport=nccl", "device=cuda", "sampler.num_engines=3", "ray.address=auto"))
