"""The tpu_sync transport without a TPU: slot plan, packing, handshake and checks, over a stand-in synchronizer.

`FakeSynchronizer` has the calls rl_tpu makes on TPU Sync's `WeightSynchronizer` (constructor
with device tensors and a listening port, d2h, push_weights, wait_for_transfer_completion, h2d)
and moves bytes with plain CPU copies. The real library is only importable on a TPU host.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from rl_tpu import sync
from rl_tpu.sync_tpu import ALIGN, SlotPlan, TpuSyncTransport, default_factory, open_receiver


class FakeSynchronizer:
    listeners: dict[int, "FakeSynchronizer"] = {}
    ports = itertools.count(40000)
    corrupt: tuple[int, int] | None = None  # (slot, byte) flipped in flight

    def __init__(self, device_tensors, local_port=None, parallelism=1, bind_ip=None, **options):
        self.device_tensors = device_tensors
        self.host = [[t.clone() for t in layer] for layer in device_tensors]
        self.local_port = next(self.ports)
        self.listeners[self.local_port] = self
        self.pushes = 0

    def d2h(self):
        self.host = [[t.clone() for t in layer] for layer in self.device_tensors]

    def push_weights(self, peers):
        for peer in peers:
            receiver = self.listeners[int(peer.rsplit(":", 1)[1])]
            receiver.host = [[t.clone() for t in layer] for layer in self.host]
            if self.corrupt is not None:
                slot, byte = self.corrupt
                receiver.host[slot][0][byte] ^= 0xFF
        self.pushes += 1

    def wait_for_transfer_completion(self, uuid=None):
        pass

    def h2d(self):
        for layer, host_layer in zip(self.device_tensors, self.host):
            for tensor, host in zip(layer, host_layer):
                tensor.copy_(host)


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


def connected(state) -> tuple[TpuSyncTransport, str, SlotPlan]:
    plan = SlotPlan.of(state, int(BUCKET_MB * 2**20))
    endpoint = open_receiver(plan, torch.device("cpu"), factory=FakeSynchronizer)
    sender = TpuSyncTransport(factory=FakeSynchronizer)
    sender.connect(plan, [endpoint], torch.device("cpu"))
    return sender, endpoint, plan


def test_slot_plan_matches_the_bundle_buckets_with_equal_aligned_slots():
    state = model_state(0)
    plan = SlotPlan.of(state, int(BUCKET_MB * 2**20))
    groups = sync.plan_buckets({n: t.nbytes for n, t in state.items()}, int(BUCKET_MB * 2**20))
    assert [[s.name for s in bucket] for bucket in plan.buckets] == groups and len(groups) >= 3
    assert plan.buckets[0] == (sync.spec_of("model.embed_tokens.weight", state["model.embed_tokens.weight"]),)
    for index, bucket in enumerate(plan.buckets):
        offsets = plan.offsets(index)
        assert all(o % ALIGN == 0 for o in offsets)
        assert offsets[-1] + bucket[-1].num_bytes <= plan.slot_bytes
    assert plan.slot_bytes % ALIGN == 0 and all(len(layer) == 1 for layer in plan.allocate(torch.device("cpu")))


def test_push_delivers_bit_identical_weights_and_new_versions():
    state = model_state(0)
    sender, endpoint, plan = connected(state)
    for version, weights in [(1, state), (2, model_state(1))]:
        bundle = sync.pack(weights, version, sender, BUCKET_MB)
        assert bundle.transport == "tpu_sync" and len(bundle.buckets) == len(plan.buckets)
        assert all(b.handle["endpoints"] == [endpoint] for b in bundle.buckets)
        tensors, _ = sync.unpack(bundle)
        received = dict(tensors)
        assert received.keys() == weights.keys()
        for name, tensor in weights.items():
            assert received[name].dtype == tensor.dtype and torch.equal(received[name], tensor), name
    assert sender.synchronizer.pushes == 2


def test_corrupted_push_is_caught_by_the_checksum():
    state = model_state(0)
    sender, _, plan = connected(state)
    FakeSynchronizer.corrupt = (1, plan.offsets(1)[0] + 3)
    bundle = sync.pack(state, 1, sender, BUCKET_MB)
    with pytest.raises(sync.WeightSyncError, match="bucket 1 of .* fails its checksum .tpu_sync.; nothing was installed"):
        sync.unpack(bundle)


def test_sender_refuses_weights_that_do_not_match_the_plan():
    state = model_state(0)
    with pytest.raises(sync.WeightSyncError, match="before connect"):
        sync.pack(state, 1, TpuSyncTransport(factory=FakeSynchronizer), BUCKET_MB)
    sender, _, _ = connected(state)
    changed = dict(state, **{"model.norm.weight": torch.randn(64)})
    with pytest.raises(sync.WeightSyncError, match="does not match the tpu_sync slot plan"):
        sync.pack(changed, 1, sender, BUCKET_MB)


def test_transport_is_selectable_and_the_library_is_imported_lazily():
    assert isinstance(sync.make_transport("tpu_sync"), TpuSyncTransport)
    assert "tpu_sync" in sync.TRANSPORT_NAMES
    try:
        import tpu_sync  # noqa: F401
    except ImportError:
        with pytest.raises(RuntimeError, match="needs TPU Sync's PyTorch package .tpu-sync-torch"):
            default_factory()
    else:
        pytest.skip("TPU Sync is installed here: the missing-library message cannot be shown")
