"""A transport is its module plus a name: one defined outside rl_tpu (tests/fixtures/transports.py) is named by import
path and asked by every check, and the built-in ones keep their facts and checks in their own classes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from conftest import REPO, compose_run

from rl_tpu.cluster.placement import PlacementError
from rl_tpu.controller.actors import check_transport_reach, restarts_in_place
from rl_tpu.controller.checks import validate
from rl_tpu.sampler.engine import EngineOptions, engine_args
from rl_tpu.sync.registry import make_transport, transport_class

PLUGIN = "handshake_transport:HandshakeStore"  # tests/fixtures/handshake_transport.py


@pytest.fixture(autouse=True)
def fixtures_importable(monkeypatch):
    """The fixture module on the path, as a user's own package would be (a `tests` package in site-packages would
    hide this checkout's tests folder from an import path)."""
    monkeypatch.syspath_prepend(str(REPO / "tests" / "fixtures"))


def placed(layout: str = "disaggregated", sleep: bool = False, engine_nodes: tuple[str, ...] = ("a",)):
    """A stand-in for `placement.Reservation`: trainer rank 0 on node a, the engines on `engine_nodes`."""
    plan = SimpleNamespace(layout=layout, engines_sleep=sleep, num_engines=len(engine_nodes))
    return SimpleNamespace(plan=plan, trainer_node=lambda rank: "a", sampler_node=lambda engine: engine_nodes[engine])


def test_a_transport_from_outside_sync_is_named_by_import_path_and_asked_by_every_check():
    cfg = compose_run(f"sync.transport={PLUGIN}", "sampler.num_engines=2")
    validate(cfg)  # the config takes the path, the checks find the class
    from handshake_transport import HandshakeStore

    assert transport_class(PLUGIN) is HandshakeStore and not restarts_in_place(cfg)
    assert restarts_in_place(compose_run("sync.transport=shm_file"))
    with pytest.raises(ValueError, match="HandshakeStore serves at most 2 engines .sampler.num_engines=3"):
        validate(compose_run(f"sync.transport={PLUGIN}", "sampler.num_engines=3"))
    check_transport_reach(cfg, placed(engine_nodes=("a", "a")))
    with pytest.raises(PlacementError, match=r"HandshakeStore: engines \[1\] are on another node"):
        check_transport_reach(cfg, placed(engine_nodes=("a", "b")))
    sender = make_transport(PLUGIN)  # its bundles carry the name the engines look the class up by
    assert isinstance(sender, HandshakeStore) and sender.name == PLUGIN


@pytest.mark.parametrize(
    "name, message",
    [
        ("rdma", "sync.transport='rdma': allowed values are object_store, shm_file, collective, cuda_ipc, tpu_sync"),
        ("handshake_transports:HandshakeStore", "'handshake_transports:HandshakeStore': cannot import HandshakeStore"),
        ("handshake_transport:MAX_ENGINES", "is 2, not a subclass of rl_tpu.sync.base.Transport"),
    ],
)
def test_a_transport_that_is_not_one_is_refused_before_ray_naming_the_key(name, message):
    with pytest.raises(ValueError, match=message):
        validate(compose_run(f"sync.transport={name}"))


def test_the_built_in_transports_check_where_the_actors_were_placed():
    cfg = compose_run("sync.transport=shm_file", "sampler.num_engines=2")
    with pytest.raises(PlacementError, match=r"shm_file passes weights as files .* engine\(s\) \[1\] were placed"):
        check_transport_reach(cfg, placed(engine_nodes=("a", "b")))
    cfg.sync.transport = "cuda_ipc"
    with pytest.raises(PlacementError, match="cuda_ipc hands GPU memory .* layout is disaggregated, not colocated"):
        check_transport_reach(cfg, placed())
    check_transport_reach(cfg, placed("colocated", sleep=True))
    cfg.sync.transport = "nccl"
    with pytest.raises(PlacementError, match="nccl joins trainer rank 0 .* layout is colocated, colocated: use"):
        check_transport_reach(cfg, placed("colocated", sleep=True))
    check_transport_reach(cfg, placed(engine_nodes=("b", "c")))


def test_a_transport_names_the_device_kinds_and_engine_settings_it_needs():
    cfg = compose_run("sync.transport=tpu_sync")
    with pytest.raises(ValueError, match="sync.transport=tpu_sync runs on tpu only, but this run is on cpu"):
        transport_class("tpu_sync").check_device(cfg, "cpu")
    transport_class("collective").check_device(cfg, "tpu")
    nccl = engine_args(EngineOptions(transport="nccl"), None, False, [])
    assert nccl["weight_transfer_config"] == {"backend": "nccl"}
    assert "weight_transfer_config" not in engine_args(EngineOptions(), None, False, [])
