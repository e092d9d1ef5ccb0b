"""`sync.transport=cuda_ipc`'s logic, run on the CPU: buckets stay where they were gathered, a device checksum checks
them there, the version window keeps what an engine may still read, and a bad bucket is refused. The CUDA handoff
itself runs in `benchmarks/device_check.py --checks ipc` on a GPU host."""

from __future__ import annotations

import pytest
import torch

from rl_tpu.records import WeightSyncError
from rl_tpu.sync import bundle as bundle_format
from rl_tpu.sync.bundle import device_checksum
from rl_tpu.sync.cuda_ipc import CudaIpcTransport, open_shared
from rl_tpu.sync.endpoints import pack, unpack


def test_the_device_checksum_sees_a_changed_moved_or_lost_byte_and_not_the_chunking(monkeypatch):
    data = torch.randint(0, 256, (1001,), dtype=torch.uint8)
    reference = device_checksum(data)
    assert device_checksum(data.clone()) == reference
    changed = data.clone()
    changed[500] ^= 1
    swapped = data.clone()
    swapped[[10, 11, 12, 13]] = data[[12, 13, 10, 11]]  # two 16-bit words trade places
    assert data[10:12].tolist() != data[12:14].tolist()
    for other in (changed, swapped, data[:-1], torch.cat([data, torch.zeros(1, dtype=torch.uint8)])):
        assert device_checksum(other) != reference
    monkeypatch.setattr(bundle_format, "CHECKSUM_CHUNK_WORDS", 7)  # exact integer sums: any split gives the same
    assert device_checksum(data) == reference


def model_weights() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {
        "model.embed_tokens.weight": torch.randn(64, 16),
        "model.layers.0.mlp.up_proj.weight": torch.randn(32, 16).to(torch.bfloat16),
        "model.norm.weight": torch.randn(16),
    }


def test_a_bundle_travels_as_flat_buffers_and_arrives_bit_for_bit():
    weights, transport = model_weights(), CudaIpcTransport()
    bundle = pack(weights, version=1, transport=transport, bucket_mb=0.002)  # 2 KB buckets: several
    assert bundle.transport == "cuda_ipc" and len(bundle.buckets) == 2  # the embedding alone, then the rest
    assert bundle.num_bytes == sum(t.nbytes for t in weights.values())
    received, timings = unpack(bundle)
    assert [name for name, _ in received] == list(weights)
    assert all(torch.equal(tensor, weights[name]) for name, tensor in received)
    assert set(timings) == {"fetch_s", "verify_s"}


def test_the_sender_keeps_this_version_and_the_one_before_for_engines_still_reading():
    transport = CudaIpcTransport()
    for version in (1, 2, 3):
        pack(model_weights(), version=version, transport=transport, bucket_mb=0.002)
    assert sorted(transport.kept) == [2, 3] and len(transport.kept[3]) == 2
    transport.close()
    assert not transport.kept


def test_a_bucket_changed_after_its_checksum_or_not_filling_its_specs_is_refused():
    transport = CudaIpcTransport()
    bundle = pack(model_weights(), version=4, transport=transport, bucket_mb=0.002)
    transport.kept[4][1][7] ^= 0xFF  # the shared buffer, written after the sender checksummed it
    with pytest.raises(WeightSyncError, match=r"weight bundle v4: bucket 1 of 2 fails its checksum \(cuda_ipc\)"):
        unpack(bundle)
    bucket = pack(model_weights(), version=5, transport=transport, bucket_mb=1).buckets[0]
    short = bucket.specs[:-1]  # a weight left out of the bucket's specs
    with pytest.raises(WeightSyncError, match="bytes does not hold its 2 tensors"):
        bundle_format.split_flat(open_shared(bucket.handle), short)


def test_a_handle_from_a_gpu_this_process_does_not_see_is_refused_naming_the_layout():
    handle = {"rebuild": None, "args": (), "gpu_uuid": "GPU-0000"}
    with pytest.raises(WeightSyncError, match="needs trainer rank 0 and the engine on one GPU"):
        open_shared(handle)
