"""The tpu_sync transport without a TPU: slot plan, packing, handshake and checks.

`FakeSynchronizer` stands in for TPU Sync's `WeightSynchronizer` with the same signatures as the
pinned `tpu-sync-torch` (requirements/tpu.txt; `test_stand_in_matches_the_real_signatures` checks
them where the package imports) and the same behaviour where rl_tpu relies on it: one host
staging buffer per registered tensor, `get_host_buffer` views of them, `push_weights` = d2h of
every layer then a write into each peer's staging buffers, h2d/d2h between staging buffers and
device tensors, and a `wait_for_transfer_completion` that never returns after a plain push.

The `real_*` tests run the transport through TPU Sync's own CPU test instance
(`WeightSynchronizer.test_only_create_cpu_instance`) over loopback TCP; they skip unless
`tpu_sync` imports, which needs Python 3.12 with tpu-sync-torch, torch-tpu and libtpu.
"""

from __future__ import annotations

import importlib
import inspect
import itertools
from collections import Counter

import pytest
import torch

from rl_tpu.records import WeightSyncError
from rl_tpu.sync.bundle import plan_buckets, spec_of
from rl_tpu.sync.endpoints import pack, unpack
from rl_tpu.sync.registry import TRANSPORT_NAMES, make_transport
from rl_tpu.sync.tpu_sync import ALIGN, SlotPlan, TpuSyncTransport, default_factory, open_receiver

SCRATCHPAD = 256 * 1024  # TPU Sync's host buffers are this much longer than the device tensor


def endpoint_of(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class FakeSynchronizer:
    listeners: dict[int, "FakeSynchronizer"] = {}
    ports = itertools.count(40000)
    corrupt: tuple[int, int] | None = None  # (slot, byte) flipped in flight

    def __init__(
        self,
        device_tensors,
        local_port=None,
        parallelism=1,
        listener_port=None,
        bind_ip=None,
        unsafe_skip_buffer_lock=True,
        auto_h2d=False,
        global_shard_indices=None,
    ):
        self.device_tensors = device_tensors
        self.options = {
            "local_port": local_port,
            "parallelism": parallelism,
            "listener_port": listener_port,
            "bind_ip": bind_ip,
            "auto_h2d": auto_h2d,
        }
        self.ip = bind_ip or "127.0.0.1"  # the real one picks this host's data NIC when bind_ip is None
        self.host = [[torch.zeros(t.nbytes + SCRATCHPAD, dtype=torch.uint8) for t in layer] for layer in device_tensors]
        self._port = next(self.ports) if not local_port else local_port
        self.listeners[self._port] = self
        self.calls: Counter[str] = Counter()

    @property
    def local_port(self):
        return self._port

    def get_local_endpoints(self):
        shards = list(range(len(self.host[0])))
        return [{"endpoint": endpoint_of(self.ip, self._port), "shards": shards, "global_shards": shards}]

    def get_host_buffer(self, layer_idx=0, shard_idx=0):
        return self.host[layer_idx][shard_idx]

    def _device_bytes(self):
        if not self.device_tensors:
            raise RuntimeError("WeightSynchronizer device weights are unbound; call bind_weights() first")
        return [[t.view(-1).view(torch.uint8) for t in layer] for layer in self.device_tensors]

    def d2h(self):
        self.calls["d2h"] += 1
        self._d2h()

    def _d2h(self):
        for layer, host_layer in zip(self._device_bytes(), self.host):
            for device, host in zip(layer, host_layer):
                host[: device.numel()].copy_(device)

    def h2d(self):
        self.calls["h2d"] += 1
        for layer, host_layer in zip(self._device_bytes(), self.host):
            for device, host in zip(layer, host_layer):
                device.copy_(host[: device.numel()])

    def push_weights(self, peers):
        self.calls["push_weights"] += 1
        if not peers:
            raise RuntimeError(
                "WeightSynchronizer PushWeights failed: Peer list cannot be empty for trainer weights sync"
            )
        self._d2h()  # as the real one: every push starts with a d2h of the registered device tensors
        for peer in peers:
            ip, port = peer.rsplit(":", 1)
            receiver = self.listeners.get(int(port))
            if receiver is None or endpoint_of(receiver.ip, receiver._port) != peer or ip.strip("[]") != receiver.ip:
                raise RuntimeError(f"WeightSynchronizer PushWeights failed: cannot connect to {peer}")
            for dst_layer, src_layer in zip(receiver.host, self.host, strict=True):
                for dst, src in zip(dst_layer, src_layer, strict=True):
                    dst.copy_(src)
            if self.corrupt is not None:
                slot, byte = self.corrupt
                receiver.host[slot][0][byte] ^= 0xFF

    def wait_for_transfer_completion(self, uuid=None):
        # TPU Sync records completion only for uuid-carrying (controller-driven) transfers
        raise AssertionError("wait_for_transfer_completion() would block forever after a plain push_weights")

    def bind_weights(self, device_tensors):
        if not device_tensors:
            self.unbind_weights()
            return
        self.device_tensors = device_tensors

    def unbind_weights(self):
        self.calls["unbind_weights"] += 1
        self.device_tensors = []

    def shutdown(self):
        self.listeners.pop(self._port, None)


@pytest.fixture(autouse=True)
def no_corruption():
    FakeSynchronizer.corrupt = None
    yield
    FakeSynchronizer.corrupt = None


def model_state(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.embed_tokens.weight": torch.randn(300, 64, generator=g),
        "model.layers.0.self_attn.q_proj.weight": torch.randn(64, 64, generator=g).bfloat16(),
        "model.layers.0.self_attn.k_proj.weight": torch.randn(32, 64, generator=g).bfloat16(),
        "model.layers.0.input_layernorm.weight": torch.randn(64, generator=g),
        "model.layers.0.mlp.gate_proj.weight": torch.randn(96, 64, generator=g),
        "model.norm.weight": torch.randn(63, generator=g),  # an odd size: padding and alignment
    }


BUCKET_MB = 0.025  # 26 KB: three slots, the embedding (77 KB) alone in the first
CPU = torch.device("cpu")


def connected(state, factory=FakeSynchronizer, host="127.0.0.1") -> tuple[TpuSyncTransport, str, SlotPlan]:
    plan = SlotPlan.of(state, int(BUCKET_MB * 2**20))
    endpoint = open_receiver(plan, CPU, host, factory=factory)
    sender = TpuSyncTransport(factory=factory)
    sender.connect(plan, [endpoint], CPU)
    return sender, endpoint, plan


def assert_round_trips(sender: TpuSyncTransport, endpoint: str, plan: SlotPlan) -> None:
    """Two versions pushed and unpacked: every tensor comes back bit-identical."""
    for version, weights in [(1, model_state(0)), (2, model_state(1))]:
        bundle = pack(weights, version, sender, BUCKET_MB)
        assert bundle.transport == "tpu_sync" and len(bundle.buckets) == len(plan.buckets)
        assert all(b.handle["endpoints"] == [endpoint] for b in bundle.buckets)
        tensors, _ = unpack(bundle)
        received = dict(tensors)
        assert received.keys() == weights.keys()
        for name, tensor in weights.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name


def test_slot_plan_matches_the_bundle_buckets_with_equal_aligned_slots():
    state = model_state(0)
    plan = SlotPlan.of(state, int(BUCKET_MB * 2**20))
    groups = plan_buckets({n: t.nbytes for n, t in state.items()}, int(BUCKET_MB * 2**20))
    assert [[s.name for s in bucket] for bucket in plan.buckets] == groups and len(groups) >= 3
    assert plan.buckets[0] == (spec_of("model.embed_tokens.weight", state["model.embed_tokens.weight"]),)
    for index, bucket in enumerate(plan.buckets):
        offsets = plan.offsets(index)
        assert all(o % ALIGN == 0 for o in offsets)
        assert offsets[-1] + bucket[-1].num_bytes <= plan.slot_bytes
    assert plan.slot_bytes % ALIGN == 0 and all(len(layer) == 1 for layer in plan.allocate(CPU))


def test_push_delivers_bit_identical_weights_and_new_versions():
    sender, endpoint, plan = connected(model_state(0))
    assert_round_trips(sender, endpoint, plan)
    assert sender.synchronizer.calls["push_weights"] == 2


def test_one_sync_copies_once_each_way_on_the_sender_and_never_on_the_receiver():
    sender, endpoint, _ = connected(model_state(0))
    receiver = TpuSyncTransport._receivers[endpoint].synchronizer
    assert receiver.calls["unbind_weights"] == 1 and receiver.device_tensors == []  # its device slots are freed
    bundle = pack(model_state(0), 1, sender, BUCKET_MB)
    unpack(bundle)
    # sender: h2d into the device slots, then push_weights' own d2h; no d2h of ours on top
    assert sender.synchronizer.calls == Counter({"h2d": 1, "push_weights": 1})
    assert receiver.calls == Counter({"unbind_weights": 1})  # no h2d, no d2h, no wait_for_transfer_completion
    assert sender.synchronizer.options == {
        "local_port": 0,
        "parallelism": 4,
        "listener_port": None,
        "bind_ip": None,
        "auto_h2d": False,
    }


def test_receiver_binds_to_and_advertises_the_callers_host():
    assert inspect.signature(open_receiver).parameters["host"].default is inspect.Parameter.empty
    state = model_state(0)
    sender, endpoint, plan = connected(state, host="10.1.2.3")  # the stand-in opens no socket
    receiver = TpuSyncTransport._receivers[endpoint].synchronizer
    assert receiver.options["bind_ip"] == "10.1.2.3" and endpoint == f"10.1.2.3:{receiver.local_port}"
    unpack(pack(state, 1, sender, BUCKET_MB))
    v6 = open_receiver(plan, CPU, "fd00::5", factory=FakeSynchronizer)
    assert v6 == f"[fd00::5]:{TpuSyncTransport._receivers[v6].synchronizer.local_port}"


def test_corrupted_push_is_caught_by_the_checksum():
    state = model_state(0)
    sender, _, plan = connected(state)
    FakeSynchronizer.corrupt = (1, plan.offsets(1)[0] + 3)
    bundle = pack(state, 1, sender, BUCKET_MB)
    with pytest.raises(WeightSyncError, match="bucket 1 of .* fails its checksum .tpu_sync.; nothing was installed"):
        unpack(bundle)


def test_sender_refuses_weights_that_do_not_match_the_plan():
    state = model_state(0)
    with pytest.raises(WeightSyncError, match="before connect"):
        pack(state, 1, TpuSyncTransport(factory=FakeSynchronizer), BUCKET_MB)
    sender, _, _ = connected(state)
    changed = dict(state, **{"model.norm.weight": torch.randn(64)})
    with pytest.raises(WeightSyncError, match="does not match the tpu_sync slot plan"):
        pack(changed, 1, sender, BUCKET_MB)


def test_transport_is_selectable_and_the_library_is_imported_lazily():
    assert isinstance(make_transport("tpu_sync"), TpuSyncTransport)
    assert "tpu_sync" in TRANSPORT_NAMES
    try:
        importlib.import_module("tpu_sync.api.torch.weight_synchronizer")
    except (ImportError, OSError):
        with pytest.raises(RuntimeError, match="needs TPU Sync's PyTorch package .tpu-sync-torch"):
            default_factory()
    else:
        pytest.skip("TPU Sync is installed here: the missing-library message cannot be shown")


# --- the real package, where it imports: TPU Sync's CPU test instance over loopback TCP ---


@pytest.fixture(scope="module")
def real_synchronizer():
    try:
        from tpu_sync.api.torch.weight_synchronizer import WeightSynchronizer
    except (ImportError, OSError) as err:
        pytest.skip(
            f"tpu_sync is not importable ({type(err).__name__}: {err}); these tests need Python 3.12 with "
            "tpu-sync-torch, torch-tpu and libtpu as pinned in requirements/tpu.txt"
        )
    if not hasattr(WeightSynchronizer, "test_only_create_cpu_instance"):
        pytest.skip("this tpu-sync-torch build has no test_only_create_cpu_instance (pin: requirements/tpu.txt)")
    return WeightSynchronizer


def cpu_instances(real):
    """A factory with WeightSynchronizer's signature that makes TPU Sync's CPU test instances.

    They hold host staging buffers and no device tensors, so their h2d/d2h do nothing and
    push_weights sends the staging buffers as they are: what rl_tpu writes and reads.
    """

    def factory(
        device_tensors,
        local_port=None,
        parallelism=1,
        listener_port=None,
        bind_ip=None,
        unsafe_skip_buffer_lock=True,
        auto_h2d=False,
        global_shard_indices=None,
    ):
        return real.test_only_create_cpu_instance(
            num_layers=len(device_tensors),
            num_shards=len(device_tensors[0]),
            slice_byte_size=device_tensors[0][0].nbytes,
            local_port=local_port,
            parallelism=parallelism,
            listener_port=listener_port,
            bind_ip=bind_ip or "127.0.0.1",
            auto_h2d=auto_h2d,
            global_shard_indices=global_shard_indices,
        )

    return factory


def test_real_cpu_instances_deliver_bit_identical_weights_and_new_versions(real_synchronizer):
    sender, endpoint, plan = connected(model_state(0), factory=cpu_instances(real_synchronizer))
    assert endpoint == f"127.0.0.1:{TpuSyncTransport._receivers[endpoint].synchronizer.local_port}"
    assert_round_trips(sender, endpoint, plan)


def test_real_cpu_instances_corrupted_slot_is_caught(real_synchronizer):
    state = model_state(0)
    sender, endpoint, plan = connected(state, factory=cpu_instances(real_synchronizer))
    bundle = pack(state, 1, sender, BUCKET_MB)  # pushed: the receiver's staging buffers hold it
    TpuSyncTransport._receivers[endpoint].synchronizer.get_host_buffer(1, 0)[plan.offsets(1)[0] + 3] ^= 0xFF
    with pytest.raises(WeightSyncError, match="bucket 1 of .* fails its checksum .tpu_sync.; nothing was installed"):
        unpack(bundle)


def test_stand_in_matches_the_real_signatures(real_synchronizer):
    def shape(function):
        return [(p.name, p.kind, p.default) for p in inspect.signature(function).parameters.values()]

    for name in (
        "__init__",
        "push_weights",
        "d2h",
        "h2d",
        "wait_for_transfer_completion",
        "get_host_buffer",
        "get_local_endpoints",
        "bind_weights",
        "unbind_weights",
        "shutdown",
    ):
        assert shape(getattr(FakeSynchronizer, name)) == shape(getattr(real_synchronizer, name)), name
    assert isinstance(inspect.getattr_static(real_synchronizer, "local_port"), property)
