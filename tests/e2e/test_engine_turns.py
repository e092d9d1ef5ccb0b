"""An install goes in after the generations sent before it, and before any generation not yet started beside it;
generations the pool sends behind an install it has not waited for run with that install's weights."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import ray
from conftest import ship_by_value

from rl_tpu.sampler.engine import SAMPLER_CONCURRENCY, EngineTurns

ship_by_value(__name__)


def wait_until(condition, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not reached in time"
        time.sleep(0.005)


def test_waiting_install_goes_before_the_next_generation():
    turns, order, release = EngineTurns(), [], threading.Event()

    def generation(name: str, hold: threading.Event | None = None) -> None:
        with turns.generation():
            order.append(name)
            if hold:
                hold.wait(10)

    def install() -> None:
        with turns.install():
            order.append("install")

    first = threading.Thread(target=generation, args=("generate 1", release))
    first.start()
    wait_until(lambda: order == ["generate 1"])
    second = threading.Thread(target=generation, args=("generate 2",))
    second.start()
    time.sleep(0.05)  # the second generation now waits for the first
    weights = threading.Thread(target=install)
    weights.start()
    wait_until(lambda: turns._installs_waiting == 1)
    release.set()
    for thread in (first, second, weights):
        thread.join(10)
    assert order == ["generate 1", "install", "generate 2"]


class SlowEngine:
    """The sampler's shape without vLLM: generations hold the engine; installs run in their own group."""

    def __init__(self):
        self.turns, self.version, self.log = EngineTurns(), 0, []

    def generate(self, seconds: float) -> int:
        with self.turns.generation():
            self.log.append(f"generate with v{self.version}")
            time.sleep(seconds)
            return self.version

    @ray.method(concurrency_group="weights")
    def install(self, version: int, earlier: list | None = None) -> str:
        with self.turns.install(earlier):
            self.version = version
            self.log.append(f"install v{version}")
        return "\n".join(self.log)

    @ray.method(concurrency_group="weights")
    def events(self) -> list[str]:
        return list(self.log)


def test_an_install_goes_in_after_the_generations_sent_before_it_whatever_their_timing(ray_cluster):
    """The pool's order: generations queued before the install keep the old weights even when the install is
    ready before they start (it was not, until 2026-12-06: then a batch's weights depended on timing)."""
    engine = ray.remote(concurrency_groups=SAMPLER_CONCURRENCY)(SlowEngine).options(num_cpus=0).remote()
    ray.get(engine.__ray_ready__.remote(), timeout=60)
    under_way = engine.generate.remote(2.0)
    queued = [engine.generate.remote(0.1), engine.generate.remote(0.1)]
    wait_until(lambda: ray.get(engine.events.remote(), timeout=30) == ["generate with v0"], timeout_s=30)
    log = ray.get(engine.install.remote(1, earlier=[under_way, *queued]), timeout=30)  # in a list: unresolved
    assert ray.get([under_way, *queued], timeout=30) == [0, 0, 0]
    assert log.splitlines() == ["generate with v0"] * 3 + ["install v1"]


class InstallingEngine:
    """The sampler's calls as `SamplerPool` makes them, without vLLM: a slow install, and generations whose
    rollouts carry the weight version they were made with."""

    def __init__(self):
        self.version = 0

    def generate(self, prompts, settings, seeds=None, tools_kwargs=None, after=None) -> list:
        from rl_tpu.records import Rollout

        return [Rollout(p, [1], [0.0], self.version, "stop", g) for g, p in enumerate(prompts)]

    @ray.method(concurrency_group="weights")
    def install(self, bundle, resent: bool = False, earlier: list | None = None) -> dict:
        time.sleep(1.0)
        if bundle.bad:
            raise ValueError(f"bundle v{bundle.version} fails its checksum")
        self.version = bundle.version
        return {"receive_s": 1.0, "install_wait_s": 0.0, "peak_rss_mb": 1.0, "version": self.version, "busy_s": 1.0}


def test_generations_sent_behind_an_install_not_waited_for_run_with_its_weights(ray_cluster):
    """Async steps: the pool sends the install and the next generations at once and waits for neither; every
    generation runs with the new weights, and one behind a failed install fails naming it."""
    from types import SimpleNamespace

    from rl_tpu.cluster.calls import ActorError
    from rl_tpu.sampler.pool import SamplerPool

    engines = [
        ray.remote(concurrency_groups=SAMPLER_CONCURRENCY)(InstallingEngine).options(num_cpus=0).remote()
        for _ in range(2)
    ]
    pool = SamplerPool(engines)
    sent = time.monotonic()
    assert pool.start_install(SimpleNamespace(version=1, bad=False, canary=None), timeout_s=60) == {}
    pending = pool.generate([[1], [2], [3]], settings=None)
    assert time.monotonic() - sent < 0.9  # neither waited for the 1 s install
    assert {r.weight_version for r in pending.result(timeout_s=60)} == {1}
    assert (
        pool.start_install(SimpleNamespace(version=2, bad=True, canary=None), timeout_s=60)["version"] == 1
    )  # v1's figures
    behind_the_bad_one = pool.generate([[1], [2]], settings=None)
    with pytest.raises(ActorError, match="bundle v2 fails its checksum"):
        behind_the_bad_one.result(timeout_s=60)
    with pytest.raises(ActorError, match="installing weights v2 failed in sampler_0"):
        pool.finish_install()


class RestartableEngine(InstallingEngine):
    """An InstallingEngine that keeps the sampler's rule for an install resent after a loss (the version it
    serves already is reported, not refused) and touches a file `installing` in `folder` as an install begins."""

    def __init__(self, folder: str):
        super().__init__()
        self.installing = Path(folder) / "installing"

    @ray.method(concurrency_group="weights")
    def install(self, bundle, resent: bool = False, earlier: list | None = None) -> dict:
        if bundle.version <= self.version and not (resent and bundle.version == self.version):
            raise ValueError(f"serves v{self.version}; refusing v{bundle.version}")
        self.installing.touch()
        return super().install(bundle, resent)


def test_an_engine_lost_during_an_install_not_waited_for_is_brought_back_and_serves_the_generations(
    ray_cluster, tmp_path
):
    """Async recovery: the engine dies while an install and the generation behind it are both pending. The
    generation fails as lost, the pool waits for Ray's restart, installs the republished weights and sends the
    generation again (without the dead install as argument); the pending install then reports the version."""
    from types import SimpleNamespace

    from rl_tpu.sampler.pool import SamplerPool
    from rl_tpu.sampler.restarts import EngineRecovery

    def bundle(version: int) -> SimpleNamespace:
        return SimpleNamespace(version=version, bad=False, canary=None)

    folders = [tmp_path / str(i) for i in range(2)]
    engines = []
    for folder in folders:
        folder.mkdir()
        engines.append(
            ray.remote(concurrency_groups=SAMPLER_CONCURRENCY)(RestartableEngine)
            .options(num_cpus=0, max_restarts=1)
            .remote(str(folder))
        )
    ray.get([engine.__ray_ready__.remote() for engine in engines], timeout=60)
    republished = []
    recovery = EngineRecovery(
        republish=lambda v: republished.append(v) or bundle(v), max_restarts=1, ready_timeout_s=60
    )
    pool = SamplerPool(engines, recovery=recovery)
    pool.start_install(bundle(1), timeout_s=60)
    pending = pool.generate([[1], [2], [3], [4]], settings=None)
    wait_until(lambda: (folders[0] / "installing").exists())
    ray.kill(engines[0], no_restart=False)  # during its 1 s install, with the generation queued behind it
    rollouts = pending.result(timeout_s=60)
    assert [r.prompt_ids for r in rollouts] == [[1], [2], [3], [4]]
    assert {r.weight_version for r in rollouts} == {1}
    assert republished == [1] and pool.restarts.lives == {0: 1}
    received = pool.finish_install()
    assert received["sampler/engine_0/weight_version"] == received["sampler/engine_1/weight_version"] == 1.0
    assert received["sampler/restarts"] == 1.0
