"""Placement: layouts and bundles from the cluster's resources, and errors that name what is missing.

The plans are checked against real Ray placement groups on multi-node clusters made in the test
(`ray.cluster_utils.Cluster`) with accelerator resources declared on CPU nodes: the device stays
`cpu`, only Ray's accounting is exercised, through small probe actors placed exactly as the
trainer ranks and engines are.
"""

from __future__ import annotations

import dataclasses
import time

import pytest
from conftest import ship_by_value

from rl_tpu.cluster import placement
from rl_tpu.config import RunConfig
from rl_tpu.sampler.pool import split_evenly


def run_config(world_size: int = 1, engines: int = 1, layout: str = "auto", **ray_settings) -> RunConfig:
    cfg = RunConfig()
    cfg.trainer.world_size, cfg.sampler.num_engines, cfg.placement = world_size, engines, layout
    for key, value in ray_settings.items():
        setattr(cfg.ray, key, value)
    return cfg


# ---- plans (no Ray) ----


def test_one_gpu_is_colocated_and_the_engine_sleeps():
    plan = placement.make_plan(run_config(), "cuda", {"CPU": 8, "GPU": 1})
    assert plan.layout == "colocated" and plan.engines_sleep
    assert plan.trainer_bundles == ({"CPU": 2.0, "GPU": 1.0},) and plan.sampler_bundles == ()
    assert plan.trainer_share["GPU"] + plan.sampler_share["GPU"] == 1.0
    assert "cannot hold 1 trainer rank(s) and 1 engine(s) apart" in plan.why


def test_two_gpus_are_disaggregated():
    plan = placement.make_plan(run_config(), "cuda", {"CPU": 8, "GPU": 2})
    assert plan.layout == "disaggregated" and not plan.engines_sleep
    assert plan.trainer_bundles == ({"CPU": 1.0, "GPU": 1.0},) and plan.sampler_bundles == ({"CPU": 1.0, "GPU": 1.0},)
    assert plan.asked == {"CPU": 2.0, "GPU": 2.0}


def test_tpu_is_never_colocated():
    plan = placement.make_plan(run_config(), "tpu", {"CPU": 8, "TPU": 1})
    assert plan.layout == "disaggregated" and plan.trainer_bundles[0]["TPU"] == 1.0
    with pytest.raises(placement.PlacementError, match="colocated is not possible on TPU"):
        placement.make_plan(run_config(layout="colocated"), "tpu", {"CPU": 8, "TPU": 8})


def test_colocated_limits_name_the_keys():
    with pytest.raises(placement.PlacementError, match="sampler.num_engines=2 must be at most trainer.world_size=1"):
        placement.make_plan(run_config(engines=2, layout="colocated"), "cuda", {"CPU": 8, "GPU": 2})
    cfg = run_config()
    cfg.trainer.max_staleness = 1
    with pytest.raises(placement.PlacementError, match="trainer.max_staleness=1 needs placement=disaggregated"):
        placement.make_plan(cfg, "cuda", {"CPU": 8, "GPU": 1})  # auto -> colocated on one GPU


def test_cpu_layout_follows_the_cores():
    assert placement.make_plan(run_config(world_size=2), "cpu", {"CPU": 3}).layout == "disaggregated"
    plan = placement.make_plan(run_config(world_size=2), "cpu", {"CPU": 2})
    assert plan.layout == "colocated" and not plan.engines_sleep
    assert plan.trainer_share == plan.sampler_share == {"CPU": 0.5}


def test_device_kind_comes_from_the_cluster_not_the_driver():
    assert placement.device_kind("auto", {"CPU": 4, "GPU": 2}) == "cuda"
    assert placement.device_kind("auto", {"CPU": 4, "TPU": 4}) == "tpu"
    assert placement.device_kind("auto", {"CPU": 4}) == "cpu"
    with pytest.raises(
        placement.PlacementError, match="device=cuda needs GPU resources, but the Ray cluster has {CPU: 4}"
    ):
        placement.device_kind("cuda", {"CPU": 4, "memory": 1e9})


def test_request_checks_run_before_ray_and_name_the_key():
    with pytest.raises(ValueError, match="sampler.num_engines=0"):
        placement.check_request(run_config(engines=0))
    with pytest.raises(ValueError, match="ray.placement_timeout_s=0"):
        placement.check_request(run_config(placement_timeout_s=0))
    with pytest.raises(placement.PlacementError, match="sampler.num_engines=3 must be at most trainer.world_size=2"):
        placement.check_request(run_config(world_size=2, engines=3, layout="colocated"))


def test_more_than_the_cluster_has_fails_at_once_naming_the_resource():
    plan = placement.make_plan(run_config(world_size=2, engines=2, layout="disaggregated"), "cuda", {"GPU": 2})
    with pytest.raises(placement.PlacementError) as err:
        placement.check_fits(plan, {"CPU": 16, "GPU": 2}, [{"CPU": 16, "GPU": 2}])
    assert "missing {GPU: 2}" in str(err.value) and "has {CPU: 16, GPU: 2}" in str(err.value)
    nodes = [placement.Node({"CPU": 16}), placement.Node({"GPU": 4})]
    with pytest.raises(placement.PlacementError, match="each trainer actor needs {CPU: 1, GPU: 1} on a single node"):
        placement.check_fits(plan, {"CPU": 16, "GPU": 4}, nodes)
    labelled = placement.make_plan(run_config(), "cpu", {"CPU": 4})
    labelled = dataclasses.replace(labelled, sampler_labels={"role": "sampler"})
    with pytest.raises(placement.PlacementError, match="with labels {'role': 'sampler'} .sampler.node_labels."):
        placement.check_fits(labelled, {"CPU": 4}, [placement.Node({"CPU": 4}, {"role": "trainer"})])


def test_prompts_split_evenly_between_engines():
    assert split_evenly(5, 2) == [range(0, 3), range(3, 5)]
    assert split_evenly(2, 3) == [range(0, 1), range(1, 2)]
    assert [len(r) for r in split_evenly(16, 4)] == [4, 4, 4, 4]


# ---- plans placed on a multi-node Ray cluster with GPUs declared on CPU nodes ----


class Probe:
    """Stands where a trainer rank or an engine would: reports its node and what Ray assigned it."""

    def where(self) -> dict:
        return placement.where_am_i()


@pytest.fixture
def cluster():
    import ray
    from ray.cluster_utils import Cluster

    ship_by_value(__name__)
    made = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    yield made
    ray.shutdown()
    made.shutdown()


def place(cluster, cfg: RunConfig, node_gpus: list[int]) -> tuple[placement.Plan, list[dict], list[dict]]:
    """Nodes with 4 CPUs and the given GPUs; the plan reserved; one probe per trainer rank and engine."""
    import ray

    for gpus in node_gpus:
        cluster.add_node(num_cpus=4, num_gpus=gpus)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    plan = placement.make_plan(cfg, "cpu", ray.cluster_resources(), accelerator="GPU")
    reservation = placement.reserve(plan, timeout_s=30)
    probe = ray.remote(Probe)
    trainers = [probe.options(**reservation.trainer_options(r)).remote() for r in range(cfg.trainer.world_size)]
    engines = [probe.options(**reservation.sampler_options(e)).remote() for e in range(cfg.sampler.num_engines)]
    where = ray.get([a.where.remote() for a in trainers + engines], timeout=60)
    assert [w["node_id"] for w in where] == reservation.nodes["trainer"] + reservation.nodes["sampler"]
    return plan, where[: len(trainers)], where[len(trainers) :]


def test_one_gpu_colocates_and_places_every_actor(cluster):
    plan, trainers, engines = place(cluster, run_config(), node_gpus=[1])
    assert plan.layout == "colocated"
    assert trainers[0]["resources"]["GPU"] == engines[0]["resources"]["GPU"] == 0.5
    assert trainers[0]["node_id"] == engines[0]["node_id"]


def test_two_gpus_disaggregate(cluster):
    plan, trainers, engines = place(cluster, run_config(), node_gpus=[1, 1])
    assert plan.layout == "disaggregated"
    assert trainers[0]["resources"]["GPU"] == engines[0]["resources"]["GPU"] == 1.0
    assert trainers[0]["node_id"] != engines[0]["node_id"]  # one GPU per node: each on its own


def test_four_gpus_two_ranks_two_engines_with_ranks_packed_on_one_node(cluster):
    plan, trainers, engines = place(cluster, run_config(world_size=2, engines=2), node_gpus=[2, 2])
    assert plan.layout == "disaggregated" and len(trainers) == len(engines) == 2
    assert all(w["resources"]["GPU"] == 1.0 for w in trainers + engines)
    assert trainers[0]["node_id"] == trainers[1]["node_id"]  # the trainer's group is packed first
    assert all(e["node_id"] != trainers[0]["node_id"] for e in engines)  # no GPU left on the trainer's node


def test_unplaceable_request_fails_within_the_timeout_naming_the_resource(cluster):
    import ray

    cluster.add_node(num_cpus=4, num_gpus=2)
    ray.init(address=cluster.address)
    cluster.wait_for_nodes()
    # the cluster has the two GPUs in all, but another job holds one of them
    holder = ray.remote(Probe).options(num_gpus=1).remote()
    ray.get(holder.where.remote(), timeout=60)
    plan = placement.make_plan(run_config(layout="disaggregated"), "cpu", ray.cluster_resources(), accelerator="GPU")
    started = time.monotonic()
    with pytest.raises(placement.PlacementError) as err:
        placement.reserve(plan, timeout_s=3)
    assert time.monotonic() - started < 20
    text = str(err.value)
    assert "within ray.placement_timeout_s=3 s" in text and "missing {GPU: 1}" in text
    assert "{CPU: 4, GPU: 2} in all" in text
    given_back = time.monotonic() + 10  # the partial reservation is given back (Ray's view updates lazily)
    while ray.available_resources().get("GPU", 0) != 1 and time.monotonic() < given_back:
        time.sleep(0.2)
    assert ray.available_resources().get("GPU", 0) == 1


def test_an_engine_over_several_devices_takes_them_in_one_bundle():
    cfg = run_config()
    cfg.sampler.tensor_parallel_size = 2
    plan = placement.make_plan(cfg, "cuda", {"CPU": 8, "GPU": 3})
    assert plan.layout == "disaggregated" and plan.sampler_bundles == ({"CPU": 1.0, "GPU": 2.0},)
    with pytest.raises(placement.PlacementError, match="cannot hold sampler.tensor_parallel_size=2 devices"):
        placement.make_plan(cfg, "cuda", {"CPU": 8, "GPU": 2})  # 1 + 2 GPUs do not fit: auto would colocate
