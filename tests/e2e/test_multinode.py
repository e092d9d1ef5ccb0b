"""Runs on a multi-node Ray cluster made in the test: trainer ranks on one node, engines on another.

Each node is a real raylet with its own resources and object store (`ray.cluster_utils.Cluster`),
so weights cross between nodes' object stores, the collective group binds to rank 0's node
address, and the actors report where they run (placement.json), which the tests check against
the nodes they made.
"""

from __future__ import annotations

import json

import pytest
from conftest import compose_run

from rl_tpu.cluster.placement import PlacementError
from rl_tpu.controller.run import run as run_training
from rl_tpu.outputs.metrics import read_metrics


@pytest.fixture(scope="module")
def two_nodes(tmp_path_factory):
    """A head with no CPUs (the driver), a 2-CPU node for the trainer ranks and a 2-CPU node for the engines.

    The runs pin the roles to the nodes by Ray node labels (`trainer.node_labels`, `sampler.node_labels`).
    """
    import ray
    from ray.cluster_utils import Cluster

    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})
    trainer_node = cluster.add_node(num_cpus=2, labels={"role": "trainer"})
    sampler_node = cluster.add_node(num_cpus=2, labels={"role": "sampler"})
    ray.init(address=cluster.address, log_to_driver=False)
    cluster.wait_for_nodes()
    yield trainer_node.node_id, sampler_node.node_id, tmp_path_factory.mktemp("cache")
    ray.shutdown()
    cluster.shutdown()


def run(run_dir, cache_dir, *overrides: str) -> list[dict]:
    cfg = compose_run(
        f"cache_dir={cache_dir}",
        "model.tiny.warm_start_steps=0",
        "data.train_batch_size=4",
        "sampler.n=4",
        "data.num_eval=16",
        "trainer.eval_every=3",
        "trainer.total_steps=3",
        "trainer.world_size=2",
        "actor.entropy_coeff=0.01",
        "trainer.checkpoint_final=false",
        "ray.placement_timeout_s=60",
        "+trainer.node_labels={role: trainer}",
        "+sampler.node_labels={role: sampler}",
        *overrides,
    )
    run_training(cfg, run_dir, show_progress=False)
    return read_metrics(run_dir / "metrics.jsonl")


def actor_nodes(run_dir) -> dict[str, str]:
    record = json.loads((run_dir / "placement.json").read_text())
    return {actor["actor"]: actor["node_id"] for actor in record["actors"]}


@pytest.mark.parametrize("transport, engines", [("object_store", 1), ("collective", 2)])
def test_trainer_and_engines_on_different_nodes(two_nodes, tmp_path, transport, engines):
    trainer_node, sampler_node, cache = two_nodes
    rows = run(tmp_path, cache, f"sync.transport={transport}", f"sampler.num_engines={engines}")
    nodes = actor_nodes(tmp_path)
    assert nodes["trainer_0"] == nodes["trainer_1"] == trainer_node
    assert all(nodes[f"sampler_{e}"] == sampler_node for e in range(engines))
    assert [r["step"] for r in rows] == [0, 1, 2, 3]
    for step, row in enumerate(rows[1:], start=1):
        assert row["sync/transport"] == transport and row["sync/version"] == step
        assert row["actor/logprob_diff"] < 1e-5, "sampler and trainer disagree on the logprobs of the same tokens"
        # every engine serves the new version; each generated its share of the batch
        assert [row[f"sampler/engine_{e}/weight_version"] for e in range(engines)] == [step] * engines
        assert sum(row[f"sampler/engine_{e}/batch_share"] for e in range(engines)) == pytest.approx(1.0)
        assert all(row[f"sampler/engine_{e}/batch_share"] > 0 for e in range(engines))
    for actor in nodes:
        assert f"{actor} started" in (tmp_path / "logs" / f"{actor}.log").read_text()


def test_shm_file_across_nodes_is_refused_at_start(two_nodes, tmp_path):
    _, _, cache = two_nodes
    with pytest.raises(PlacementError, match="sync.transport=shm_file passes weights as files .* on one node"):
        run(tmp_path, cache, "sync.transport=shm_file")
    assert not (tmp_path / "metrics.jsonl").exists()
