"""Weight sync into a running vLLM engine: exact, versioned, checksummed, all-or-nothing, for every transport."""

from __future__ import annotations

import dataclasses
import shutil
import time
from pathlib import Path

import psutil
import pytest
import torch

from rl_tpu.cluster.cores import CpuBinding
from rl_tpu.models.families import LLAMA
from rl_tpu.models.logprobs import pad_batch, token_logprobs
from rl_tpu.records import Bucket, TensorSpec, TrainBatch, WeightBundle, WeightSyncError
from rl_tpu.sampler.engine import EngineOptions, SamplingSettings, launch_sampler
from rl_tpu.sync.bundle import assign_senders, check_names, engine_name, plan_buckets
from rl_tpu.sync.endpoints import pack, pack_buckets, unpack
from rl_tpu.sync.object_store import ObjectStoreTransport
from rl_tpu.sync.registry import make_transport

PROMPTS = ["Q: What is 12 + 7? A:", "Q: What is 3 - 50? A:", "Q: What is 99 + 99? A:", "Q: What is 0 - 0? A:"]
GREEDY = SamplingSettings(n=1, temperature=0.0, max_tokens=12)
CALL_TIMEOUT_S = 600  # each actor call, a compiled engine's first generation included
TRANSPORTS = ["object_store", "shm_file", "collective"]


@pytest.fixture(scope="module")
def new_weights(tiny_model_dir, tmp_path_factory):
    """A differently initialised model of the same shape, saved as its own Hugging Face folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model_dir)).float()
    folder = tmp_path_factory.mktemp("new") / "model"
    shutil.copytree(tiny_model_dir, folder)
    model.save_pretrained(folder)
    return model.eval(), folder


@pytest.fixture(scope="module")
def fresh_engine(ray_cluster, new_weights):
    sampler = launch_sampler(str(new_weights[1]), "float32", 128, 0.25, seed=0)
    yield sampler
    ray_cluster.get(sampler.shutdown.remote())


def _prompt_ids(folder):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder)
    return [tokenizer(p)["input_ids"] for p in PROMPTS]


def _generate(ray, sampler, prompts, settings=GREEDY):
    return ray.get(sampler.generate.remote(prompts, settings), timeout=CALL_TIMEOUT_S)


def _corrupt(bundle: WeightBundle, index: int) -> WeightBundle:
    """Damage one bucket in transit: flip bytes of its file, or swap in another bucket's payload."""
    bucket = bundle.buckets[index]
    if bundle.transport == "shm_file":
        path = Path(bucket.handle)
        data = bytearray(path.read_bytes())
        data[-16:] = b"\xff" * 16  # the last tensor's tail
        path.write_bytes(bytes(data))
        return bundle
    if bundle.transport == "collective":  # the stream carries no handle to swap: the bytes no longer match
        wrong = dataclasses.replace(bucket, checksum=bundle.buckets[index - 1].checksum)
        return dataclasses.replace(bundle, buckets=bundle.buckets[:index] + (wrong,) + bundle.buckets[index + 1 :])
    wrong = dataclasses.replace(bucket, handle=bundle.buckets[index - 1].handle)
    return dataclasses.replace(bundle, buckets=bundle.buckets[:index] + (wrong,) + bundle.buckets[index + 1 :])


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_sync_makes_engine_equal_a_fresh_engine_and_enforces_the_contract(
    ray_cluster, tiny_model_dir, new_weights, fresh_engine, transport, tmp_path
):
    ray = ray_cluster
    model, folder = new_weights
    prompts = _prompt_ids(folder)
    sender = make_transport(transport, str(tmp_path / "shm"))
    running = launch_sampler(str(tiny_model_dir), "float32", 128, 0.25, seed=0)
    before = _generate(ray, running, prompts)

    state = {k: v.detach().clone() for k, v in model.named_parameters()}  # as a trainer sends: a tied head once
    bundle = pack(state, version=1, transport=sender, bucket_mb=1.0)
    assert len(bundle.buckets) > 3  # 13 MB in 1 MB buckets
    ray.get(running.install.remote(bundle))
    assert ray.get(running.serving_version.remote()) == 1
    synced, expected = _generate(ray, running, prompts), _generate(ray, fresh_engine, prompts)
    assert [r.completion_ids for r in synced] == [r.completion_ids for r in expected]
    assert [r.logprobs for r in synced] == [r.logprobs for r in expected]
    assert [r.completion_ids for r in synced] != [r.completion_ids for r in before]  # the weights really changed
    assert {r.weight_version for r in synced} == {1}

    # A stale version is refused (after it is read: a collective stream must stay aligned); v1 keeps serving.
    with pytest.raises(Exception, match="refusing older or equal bundle v1"):
        ray.get(running.install.remote(pack(state, version=1, transport=sender, bucket_mb=1.0)))
    # Sent again after the engine was lost (SamplerPool.finish_install): one that serves v1 already reports it.
    again = ray.get(running.install.remote(pack(state, version=1, transport=sender, bucket_mb=1.0), resent=True))
    assert again["version"] == 1 and again["install_s"] == 0.0
    # A bucket damaged in transit fails its checksum before anything is installed.
    zeros = {k: torch.zeros_like(v) for k, v in state.items()}
    with pytest.raises(Exception, match="bucket 2 of .* fails its checksum"):
        ray.get(running.install.remote(_corrupt(pack(zeros, version=2, transport=sender, bucket_mb=1.0), 2)))
    # A bundle that lacks some weights would leave them at the old version: refused. (Not for the collective
    # transport, whose bucket list is also the broadcast schedule; the name check does not depend on transport.)
    if transport != "collective":
        full = pack(zeros, version=3, transport=sender, bucket_mb=1.0)
        partial = dataclasses.replace(full, buckets=full.buckets[1:])
        with pytest.raises(Exception, match="does not match the served model: missing"):
            ray.get(running.install.remote(partial))
    assert ray.get(running.serving_version.remote()) == 1
    assert [r.completion_ids for r in _generate(ray, running, prompts)] == [r.completion_ids for r in expected]

    assert_sampler_logprobs_match_trainer(ray, running, model, prompts)
    ray.get(running.shutdown.remote())


def assert_sampler_logprobs_match_trainer(ray, sampler, model, prompts) -> None:
    """Sampler logprobs (processed, after temperature) match a trainer-style fp32 forward of the same tokens."""
    sampled = _generate(ray, sampler, prompts, SamplingSettings(n=4, temperature=0.7, max_tokens=12))
    batch = TrainBatch(
        [r.prompt_ids for r in sampled],
        [r.completion_ids for r in sampled],
        [r.logprobs for r in sampled],
        [[0.0] * len(r.logprobs) for r in sampled],
        0.7,
    )
    t = pad_batch(batch, pad_id=1, device=torch.device("cpu"))
    with torch.no_grad():
        log_prob, _ = token_logprobs(model, t, 0.7, with_entropy=False)
    mask = t["response_mask"]
    mean_abs = ((log_prob - t["sampler_logprobs"]).abs() * mask).sum() / mask.sum()
    assert mask.sum() > 20 and mean_abs < 1e-5, f"mean |sampler - trainer| logprob = {mean_abs:.2e}"


def test_a_compiled_engine_serves_installed_weights_as_an_eager_one(
    ray_cluster, tiny_model_dir, new_weights, fresh_engine
):
    """`sampler.enforce_eager=false` on CPU: vLLM torch.compiles the model, and an install still reaches it."""
    ray = ray_cluster
    model, folder = new_weights
    prompts = _prompt_ids(folder)
    compiled = launch_sampler(
        str(tiny_model_dir), "float32", 128, 0.25, seed=0, options=EngineOptions(enforce_eager=False)
    )
    before = _generate(ray, compiled, prompts)
    assert ray.get(compiled.compiled_graphs.remote(), timeout=CALL_TIMEOUT_S) > 0
    state = {k: v.detach().clone() for k, v in model.named_parameters()}  # as a trainer sends: a tied head once
    bundle = pack(state, version=1, transport=make_transport("object_store"), bucket_mb=1.0)
    ray.get(compiled.install.remote(bundle), timeout=CALL_TIMEOUT_S)
    synced, expected = _generate(ray, compiled, prompts), _generate(ray, fresh_engine, prompts)
    assert [r.completion_ids for r in synced] == [r.completion_ids for r in expected]
    assert [r.completion_ids for r in synced] != [r.completion_ids for r in before]
    assert_sampler_logprobs_match_trainer(ray, compiled, model, prompts)
    # an eager engine compiles nothing
    assert ray.get(fresh_engine.compiled_graphs.remote(), timeout=CALL_TIMEOUT_S) == 0
    ray.get(compiled.shutdown.remote(), timeout=CALL_TIMEOUT_S)


def test_an_engine_over_two_workers_serves_installed_weights_as_one_worker_does(
    ray_cluster, tiny_model_dir, new_weights, fresh_engine
):
    """`sampler.tensor_parallel_size=2` on CPU: vLLM's tensor parallelism over two worker processes of the engine's
    actor, each loading its shard of an installed bundle from one staged file."""
    ray = ray_cluster
    model, folder = new_weights
    prompts = _prompt_ids(folder)
    options = EngineOptions(binding=CpuBinding(threads=2), tensor_parallel_size=2)
    sharded = launch_sampler(str(tiny_model_dir), "float32", 128, 0.25, seed=0, options=options)
    before = _generate(ray, sharded, prompts)
    actor = psutil.Process(ray.get(sharded.where.remote(), timeout=CALL_TIMEOUT_S)["pid"])
    workers = [p.name() for p in actor.children(recursive=True) if "Worker" in p.name()]
    assert len(workers) == 2, workers  # vLLM's worker processes, one per shard
    state = {k: v.detach().clone() for k, v in model.named_parameters()}
    bundle = pack(state, version=1, transport=make_transport("object_store"), bucket_mb=1.0)
    ray.get(sharded.install.remote(bundle), timeout=CALL_TIMEOUT_S)
    synced, expected = _generate(ray, sharded, prompts), _generate(ray, fresh_engine, prompts)
    assert [r.completion_ids for r in synced] == [r.completion_ids for r in expected]
    assert [r.completion_ids for r in synced] != [r.completion_ids for r in before]
    for ours, one_worker in zip(synced, expected):  # the shards' sums are added in another order: close, not equal
        assert ours.logprobs == pytest.approx(one_worker.logprobs, rel=1e-4, abs=1e-5)
    ray.get(sharded.shutdown.remote(), timeout=CALL_TIMEOUT_S)


@pytest.mark.parametrize("transport", TRANSPORTS)
def test_pack_unpack_is_bit_exact_for_any_dtype(ray_cluster, transport, tmp_path):
    state = {
        "a": torch.randn(300, 500),
        "b": torch.randn(7).to(torch.bfloat16),
        "c": torch.arange(4),
        "d": torch.randn(64, 64),
    }
    state["tied"] = state["d"]  # one tensor under two names, as an fp32 CPU trainer serves a tied head
    bundle = pack(state, version=3, transport=make_transport(transport, str(tmp_path)), bucket_mb=0.1)
    assert [len(b.specs) for b in bundle.buckets] == [1, 4]  # "a" (600 kB) alone, then the rest
    tensors, _ = unpack(bundle)
    assert [n for n, _ in tensors] == list(state)
    for name, tensor in tensors:
        assert tensor.dtype == state[name].dtype and torch.equal(tensor, state[name])


def test_a_bucket_that_never_arrives_fails_the_fetch_within_its_deadline(ray_cluster, monkeypatch):
    @ray_cluster.remote
    def never_sent():
        time.sleep(60)

    monkeypatch.setattr(ObjectStoreTransport, "timeout_s", 0.5)
    pending = never_sent.remote()
    bucket = Bucket((TensorSpec("w", "float32", (1,)),), "", [pending], 2)
    started = time.monotonic()
    with pytest.raises(WeightSyncError, match="bucket 2 did not come through the object store within 0.5 s"):
        unpack(WeightBundle(5, "object_store", (bucket,), 4))
    assert time.monotonic() - started < 10
    ray_cluster.cancel(pending, force=True)  # its CPU back for the engines of the tests after this one


def test_buckets_are_bounded_and_keep_order():
    sizes = {f"w{i}": 4 * n for i, n in enumerate([10, 10, 30, 5, 100, 1])}  # bytes of float32 tensors
    assert plan_buckets(sizes, bucket_bytes=80) == [["w0", "w1"], ["w2"], ["w3"], ["w4"], ["w5"]]
    assert plan_buckets(sizes, bucket_bytes=10**6) == [list(sizes)]


def test_senders_share_buckets_by_bytes():
    assert assign_senders([500, 500, 260, 240], senders=2) == [0, 1, 0, 1]
    assert assign_senders([100, 10, 10, 10], senders=2) == [0, 1, 1, 1]
    assert assign_senders([5, 5, 5], senders=1) == [0, 0, 0]


def test_parts_from_several_senders_merge_in_bucket_order(ray_cluster):
    state = {f"w{i}": torch.full((100,), float(i)) for i in range(5)}  # 400 bytes each: one bucket each
    groups = list(state.items())
    owners = assign_senders([400] * 5, senders=2)
    parts = [
        pack_buckets(({n: t} if owners[i] == rank else None for i, (n, t) in enumerate(groups)), 4) for rank in (1, 0)
    ]
    assert [[b.index for b in part.buckets] for part in parts] == [[1, 3], [0, 2, 4]]
    tensors, _ = unpack(WeightBundle.merge(parts))
    assert [n for n, _ in tensors] == list(state) and all(torch.equal(t, state[n]) for n, t in tensors)
    with pytest.raises(WeightSyncError, match="do not fit together"):
        WeightBundle.merge(parts[1:])  # a rank's part is missing
    stale = WeightBundle(3, parts[0].transport, parts[0].buckets, parts[0].num_bytes)
    with pytest.raises(WeightSyncError, match="do not fit together"):
        WeightBundle.merge([stale, parts[1]])


def test_unknown_transport_names_allowed_values():
    allowed = "allowed values are object_store, shm_file, collective, cuda_ipc, tpu_sync, nccl"
    with pytest.raises(ValueError, match=allowed):
        make_transport("rdma")


def bundle_named(names: list[str]) -> WeightBundle:
    specs = tuple(TensorSpec(n, "float32", (1,)) for n in names)
    return WeightBundle(7, "object_store", (Bucket(specs, "", None, 0),), 4 * len(names))


HF_LAYER = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.0.self_attn.k_proj.weight",
    "model.layers.0.self_attn.v_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_proj.weight",
    "model.layers.0.mlp.up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.embed_tokens.weight",  # a tied head travels once, as the embedding
]
# vLLM's Qwen3 parameter names (read from a running engine): q/k/v and gate/up are fused
FUSED_ENGINE = {
    "model.layers.0.self_attn.qkv_proj.weight",
    "model.layers.0.self_attn.o_proj.weight",
    "model.layers.0.mlp.gate_up_proj.weight",
    "model.layers.0.mlp.down_proj.weight",
    "model.embed_tokens.weight",
}


def test_names_map_onto_fused_engine_weights():
    assert engine_name("model.layers.0.self_attn.k_proj.weight", FUSED_ENGINE, LLAMA.fused_weights) == (
        "model.layers.0.self_attn.qkv_proj.weight",
        3,
    )
    assert engine_name("model.layers.0.mlp.up_proj.weight", FUSED_ENGINE, LLAMA.fused_weights) == (
        "model.layers.0.mlp.gate_up_proj.weight",
        2,
    )
    assert engine_name("model.layers.0.mlp.up_proj.weight", set(HF_LAYER), LLAMA.fused_weights) == (
        "model.layers.0.mlp.up_proj.weight",
        1,
    )  # an engine that does not fuse keeps the names
    check_names(bundle_named(HF_LAYER), FUSED_ENGINE, LLAMA.fused_weights)
    check_names(bundle_named(HF_LAYER), set(HF_LAYER), LLAMA.fused_weights)


@pytest.mark.parametrize(
    "names, message",
    [
        (
            [n for n in HF_LAYER if "v_proj" not in n],
            r"partly filled fused weights \['model.layers.0.self_attn.qkv_proj"
            r".weight \(2 of 3\)'\]",
        ),
        ([n for n in HF_LAYER if "down_proj" not in n], r"missing \['model.layers.0.mlp.down_proj.weight'\]"),
        ([*HF_LAYER, "model.layers.9.mlp.up_proj.weight"], r"unexpected \['model.layers.9.mlp.up_proj.weight'\]"),
    ],
)
def test_bundle_that_does_not_fill_the_engine_is_refused(names, message):
    with pytest.raises(WeightSyncError, match=message):
        check_names(bundle_named(names), FUSED_ENGINE, LLAMA.fused_weights)


def test_a_head_is_required_where_it_is_not_tied_and_refused_twice_where_it_is():
    """A tied head shares the embedding's parameter in the engine and travels once; an untied one is a weight."""
    untied_engine = FUSED_ENGINE | {"lm_head.weight"}
    check_names(bundle_named([*HF_LAYER, "lm_head.weight"]), untied_engine, LLAMA.fused_weights)
    with pytest.raises(WeightSyncError, match=r"missing \['lm_head.weight'\]"):
        check_names(bundle_named(HF_LAYER), untied_engine, LLAMA.fused_weights)
    with pytest.raises(WeightSyncError, match=r"unexpected \['lm_head.weight'\]"):
        check_names(bundle_named([*HF_LAYER, "lm_head.weight"]), FUSED_ENGINE, LLAMA.fused_weights)
