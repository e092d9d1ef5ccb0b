"""Placement plans reserved on real Ray placement groups (the plans alone, without Ray:
tests/unit/test_placement_plans.py).

The plans are checked against real Ray placement groups on multi-node clusters made in the test
(`ray.cluster_utils.Cluster`) with accelerator resources declared on CPU nodes: the device stays
`cpu`, only Ray's accounting is exercised, through small probe actors placed exactly as the
trainer ranks and engines are.
"""

from __future__ import annotations

import time

import pytest
from conftest import placement_config as run_config
from conftest import ship_by_value

from rl_tpu.cluster import placement
from rl_tpu.config import RunConfig

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
