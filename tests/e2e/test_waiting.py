"""Waits on actors end within their deadline and name the actor that failed or did not answer."""

from __future__ import annotations

import logging
import re
import time

import pytest
from conftest import ship_by_value

from rl_tpu.cluster.calls import ActorError, gather


class Worker:
    def nap(self, seconds: float) -> str:
        time.sleep(seconds)
        return "rested"

    def fail(self) -> None:
        raise KeyError("no_such_weight")

    def exit(self) -> None:
        import os

        os._exit(1)


@pytest.fixture
def actors(ray_cluster):
    """Fresh actors for each test: an actor runs its calls one at a time, so a nap would delay the next test."""
    ship_by_value(__name__)
    worker = ray_cluster.remote(Worker).options(num_cpus=0)
    started = [worker.remote() for _ in range(2)]
    ray_cluster.get([a.nap.remote(0.0) for a in started], timeout=60)  # started: the deadlines time the calls only
    return started


def test_answers_come_back_in_call_order(actors):
    calls = [("slow", actors[0].nap.remote(0.5)), ("fast", actors[1].nap.remote(0.0))]
    assert gather(calls, "napping", timeout_s=30) == ["rested", "rested"]


def test_a_silent_actor_is_named_after_the_deadline(actors, tmp_path):
    started = time.monotonic()
    with pytest.raises(ActorError) as err:
        gather(
            [("trainer_0", actors[0].nap.remote(0.0)), ("sampler_0", actors[1].nap.remote(5.0))],
            "generate",
            timeout_s=1.0,
            log_dir=tmp_path,
        )
    assert time.monotonic() - started < 4
    assert str(err.value) == (f"generate: no answer from sampler_0 within 1 s (see {tmp_path / 'sampler_0.log'})")


def test_a_long_wait_names_who_is_awaited_long_before_its_deadline(actors, tmp_path, caplog):
    """A hang (ranks whose collectives disagree) waits out the call's deadline, an hour by default: on the way it
    is logged when it reaches `notice_after_s`, then at each doubling, naming only those that have not answered;
    a wait of a kind that took longer before is let run NOTICE_FACTOR times that long first."""
    calls = [("trainer_0", actors[0].nap.remote(0.0)), ("trainer_1", actors[1].nap.remote(2.5))]
    with caplog.at_level(logging.WARNING, logger="rl_tpu.cluster.calls"):
        gather(calls, "train step 7", timeout_s=60, log_dir=tmp_path, notice_after_s=0.5)
    notices = [r.getMessage() for r in caplog.records]
    assert len(notices) in (2, 3), notices  # at 0.5, 1 and 2 s; the last may come with the answer on a slow host
    assert notices[0].startswith(f"train step 7: still waiting for trainer_1 (see {tmp_path / 'trainer_1.log'}) after")
    assert all("trainer_0" not in n for n in notices)
    assert 50 <= int(re.search(r"its deadline is in (\d+) s", notices[0])[1]) <= 60
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="rl_tpu.cluster.calls"):  # "train step 8" is the same kind
        gather([("trainer_1", actors[1].nap.remote(1.0))], "train step 8", timeout_s=60, notice_after_s=0.5)
    assert caplog.records == []  # within 5 x the 2.5 s the kind took before


def test_a_failure_is_reported_at_once_with_the_actor_and_its_traceback(actors):
    started = time.monotonic()
    with pytest.raises(ActorError) as err:  # the failing call does not wait for the slow one
        gather([("trainer_0", actors[0].nap.remote(5.0)), ("trainer_1", actors[1].fail.remote())], "train step", 30)
    assert time.monotonic() - started < 4
    assert str(err.value).startswith("train step failed in trainer_1:") and "KeyError: 'no_such_weight'" in str(
        err.value
    )


def test_a_dead_actor_is_named(ray_cluster):
    ship_by_value(__name__)
    doomed = ray_cluster.remote(Worker).options(num_cpus=0).remote()
    with pytest.raises(ActorError, match="installing weights v3: sampler_1 died"):
        gather([("sampler_1", doomed.exit.remote())], "installing weights v3", 30)


class Rank:
    """A trainer rank's storage view: `blind` stands for a node that does not mount the run folder."""

    def __init__(self, blind: bool):
        self.blind = blind

    def touch(self, path: str) -> None:
        from pathlib import Path

        Path(path).write_text("marker")

    def sees(self, path: str) -> bool:
        from pathlib import Path

        return Path(path).exists() and not self.blind


def test_a_run_folder_that_one_rank_cannot_see_stops_the_run(ray_cluster, tmp_path):
    from rl_tpu.config import RunConfig
    from rl_tpu.controller.actors import ActorHandles, check_shared_run_dir
    from rl_tpu.sampler.pool import SamplerPool

    ship_by_value(__name__)
    rank = ray_cluster.remote(Rank).options(num_cpus=0)
    handles = ActorHandles([rank.remote(False), rank.remote(False)], SamplerPool([]), None, RunConfig(), None)
    check_shared_run_dir(handles, tmp_path)  # both see it: passes, and leaves nothing behind
    assert list(tmp_path.iterdir()) == []
    handles.trainers.append(rank.remote(True))
    with pytest.raises(
        ActorError, match=f"the run folder {tmp_path} is not shared storage: .* not visible to trainer_2"
    ):
        check_shared_run_dir(handles, tmp_path)
