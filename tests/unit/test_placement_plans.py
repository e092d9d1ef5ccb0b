"""Placement plans from a cluster's resources, without Ray: layouts, bundles, and errors that name what is missing
(the same plans reserved on real Ray placement groups: tests/e2e/test_placement.py)."""

from __future__ import annotations

import dataclasses

import pytest
from conftest import placement_config as run_config

from rl_tpu.cluster import placement
from rl_tpu.sampler.pool import split_evenly


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


def test_an_engine_over_several_devices_takes_them_in_one_bundle():
    cfg = run_config()
    cfg.sampler.tensor_parallel_size = 2
    plan = placement.make_plan(cfg, "cuda", {"CPU": 8, "GPU": 3})
    assert plan.layout == "disaggregated" and plan.sampler_bundles == ({"CPU": 1.0, "GPU": 2.0},)
    with pytest.raises(placement.PlacementError, match="cannot hold sampler.tensor_parallel_size=2 devices"):
        placement.make_plan(cfg, "cuda", {"CPU": 8, "GPU": 2})  # 1 + 2 GPUs do not fit: auto would colocate
