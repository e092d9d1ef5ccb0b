"""Core pinning: who gets which cores, and that a process really ends up pinned with its thread count."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rl_tpu.cluster.cores import CoreLease, CoreLoan, CpuBinding, bind, should_pin
from rl_tpu.config import RunConfig


def config(staleness: int = 1, trainer_threads: int = 1, engine_threads: int | None = None) -> RunConfig:
    cfg = RunConfig()
    cfg.trainer.max_staleness, cfg.trainer.threads_per_rank, cfg.sampler.threads = (
        staleness,
        trainer_threads,
        engine_threads,
    )
    return cfg


def test_auto_pins_only_a_one_host_cpu_run_in_async_mode():
    assert should_pin(config(staleness=1), "cpu", one_host=True)
    assert not should_pin(config(staleness=0), "cpu", one_host=True)  # sync: the two sides take turns
    assert not should_pin(config(staleness=1), "cpu", one_host=False)
    assert not should_pin(config(staleness=1), "cuda", one_host=True)
    forced = config(staleness=0)
    forced.pin_cores = "on"
    assert should_pin(forced, "cpu", one_host=False)
    forced.pin_cores, forced.trainer.max_staleness = "off", 1
    assert not should_pin(forced, "cpu", one_host=True)


def test_ranks_take_the_first_cores_of_their_node_and_engines_the_next():
    cfg = config(trainer_threads=2, engine_threads=1)
    trainers, engines = bind(
        cfg, ["n1", "n1", "n2"], ["n1", "n2"], pin=True, node_cores={"n1": 8, "n2": 4}, activity_folder="run"
    )
    assert [t.cores for t in trainers] == [(0, 1), (2, 3), (0, 1)]
    assert [e.cores for e in engines] == [(4,), (2,)]
    assert [t.threads for t in trainers] == [2, 2, 2] and [e.threads for e in engines] == [1, 1]


def test_a_node_without_enough_cores_runs_its_actors_unpinned_and_says_so(caplog):
    cfg = config(trainer_threads=2, engine_threads=2)
    trainers, engines = bind(
        cfg, ["small", "big"], ["small"], pin=True, node_cores={"small": 2, "big": 4}, activity_folder="run"
    )
    assert trainers[0].cores == () and engines[0].cores == ()
    assert trainers[1].cores == (0, 1)  # the other node is still pinned
    assert "need 4 cores" in caplog.text and "has 2" in caplog.text


def test_engine_threads_default_to_its_reserved_cpus():
    cfg = config()
    cfg.sampler.num_cpus = 2.0
    _, engines = bind(cfg, ["n"], ["n"], pin=False, node_cores={"n": 2}, activity_folder="run")
    assert engines == [CpuBinding(threads=2)]


PROBE = """
import json, os, sys
from rl_tpu.cluster.cores import CpuBinding
import torch
CpuBinding(threads=1, cores=(0,)).apply("probe")
masks = {t: sorted(os.sched_getaffinity(int(t))) for t in os.listdir("/proc/self/task")}
print(json.dumps({"masks": masks, "threads": torch.get_num_threads()}))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to tell pinned from unpinned")
def test_apply_pins_every_thread_of_the_process_and_sizes_the_pool():
    env = {**os.environ, "OMP_NUM_THREADS": "2"}  # a pool of 2 exists before the binding is applied
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, env=env, check=True)
    probe = json.loads(out.stdout.strip().splitlines()[-1])
    first = sorted(os.sched_getaffinity(0))[0]
    assert len(probe["masks"]) > 1  # torch's pool threads, not only the main thread
    assert all(mask == [first] for mask in probe["masks"].values()), probe["masks"]
    assert probe["threads"] == 1


def test_a_core_the_node_does_not_have_is_refused_by_name():
    with pytest.raises(RuntimeError, match="sampler_0: pinned to core positions"):
        CpuBinding(threads=1, cores=(len(os.sched_getaffinity(0)),)).apply("sampler_0")


def test_runs_sharing_a_node_lease_disjoint_cores_and_a_dead_runs_cores_are_free_at_once(tmp_path):
    first, second = CoreLease(3, 8, str(tmp_path)), CoreLease(3, 8, str(tmp_path))
    assert (first.first, second.first) == (0, 3)
    assert CoreLease(3, 8, str(tmp_path)).first is None  # 2 positions left: no block of 3
    assert CoreLease(2, 8, str(tmp_path)).first == 6
    # a run killed with its lease held: the kernel drops its locks with the process
    holder = subprocess.Popen([sys.executable, "-c", HOLD_LEASE, str(tmp_path)], stdout=subprocess.PIPE, text=True)
    try:
        second.release()
        assert holder.stdout.readline().strip() == "3"  # it took the block the second run gave back
        assert CoreLease(3, 8, str(tmp_path)).first is None
    finally:
        holder.kill()
        holder.wait()
    assert CoreLease(3, 8, str(tmp_path)).first == 3
    first.release()


HOLD_LEASE = """
import sys, time
from rl_tpu.cluster.cores import CoreLease
while (lease := CoreLease(3, 8, sys.argv[1])).first is None:
    time.sleep(0.05)
print(lease.first, flush=True)
time.sleep(600)
"""


def test_pinned_actors_start_at_their_runs_leased_block_and_run_unpinned_without_one(caplog):
    cfg = config(trainer_threads=2, engine_threads=1)
    leased = {"n1": 4, "n2": None}
    trainers, engines = bind(
        cfg,
        ["n1", "n2"],
        ["n1", "n2"],
        pin=True,
        node_cores={"n1": 8, "n2": 8},
        activity_folder="run",
        lease=lambda node, count, cores: leased[node],
    )
    assert trainers[0].cores == (4, 5) and engines[0].cores == (6,)
    assert trainers[1].cores == () and engines[1].cores == ()
    assert "no 3 consecutive cores free of other runs" in caplog.text


def test_an_engine_over_two_cpu_workers_splits_its_cores_or_its_threads(monkeypatch):
    from rl_tpu.sampler.engine import EngineOptions, tensor_parallel_args

    for name in ("VLLM_CPU_OMP_THREADS_BIND", "OMP_NUM_THREADS"):
        monkeypatch.delenv(name, raising=False)
    assert tensor_parallel_args(EngineOptions(), on_cpu=True, allowed=[0, 1]) == {}
    pinned = EngineOptions(binding=CpuBinding(threads=4, cores=(2, 3, 4, 5)), tensor_parallel_size=2)
    args = tensor_parallel_args(pinned, on_cpu=True, allowed=[10, 11, 12, 13, 14, 15])
    assert args == {"tensor_parallel_size": 2, "distributed_executor_backend": "mp"}
    assert os.environ["VLLM_CPU_OMP_THREADS_BIND"] == "12,13|14,15"  # the node's CPUs at the engine's positions
    tensor_parallel_args(EngineOptions(binding=CpuBinding(threads=4), tensor_parallel_size=2), True, [0, 1, 2, 3])
    assert (os.environ["VLLM_CPU_OMP_THREADS_BIND"], os.environ["OMP_NUM_THREADS"]) == ("nobind", "2")


def lending() -> RunConfig:
    """Async (so engines and ranks can overlap), one thread a rank, two an engine, idle cores lent."""
    cfg = config(staleness=1, trainer_threads=1, engine_threads=2)
    cfg.trainer.borrow_idle_cores = True
    return cfg


def test_a_nodes_engine_cores_are_dealt_to_its_ranks_and_each_loan_watches_every_engine_there():
    trainers, engines = bind(
        lending(), ["n1", "n1", "n2"], ["n1", "n1"], pin=True, node_cores={"n1": 8, "n2": 4}, activity_folder="run-x"
    )
    # n1: ranks on cores 0 and 1, engines on 2-3 and 4-5
    assert [t.loan for t in trainers[:2]] == [CoreLoan((2, 4), (0, 1), "run-x"), CoreLoan((3, 5), (0, 1), "run-x")]
    assert trainers[2].loan is None  # no engine on n2
    assert [e.activity_folder for e in engines] == ["run-x", "run-x"] and all(e.loan is None for e in engines)


@pytest.mark.parametrize("change", ["unpinned", "switched off", "default"])
def test_no_loan_unpinned_switched_off_or_by_default(change):
    cfg = lending()
    cfg.trainer.borrow_idle_cores = change != "switched off"
    if change == "default":
        cfg.trainer.borrow_idle_cores = RunConfig().trainer.borrow_idle_cores
    trainers, engines = bind(cfg, ["n"], ["n"], pin=change != "unpinned", node_cores={"n": 8}, activity_folder="f")
    assert trainers[0].loan is None and engines[0].activity_folder is None
