"""OpenEnv environments under load: 256 episode sessions (`lifetime: episode`) on a real OpenEnv server on loopback,
through the real tool workers, with slow steps and a server restart in the middle of a step
(benchmarks/environments_load.py, at the size of the suite); and a session's bounded reconnect."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from collections import Counter

import pytest
from conftest import REPO, free_port

from rl_tpu.episodes.tools import ToolBox, ToolSettings

SESSIONS, SLOW = 256, 4
REPLY_S = 4.0  # the tool's reply deadline (its config timeout_s): the slow steps take a second more


@pytest.fixture(scope="module")
def load():
    spec = importlib.util.spec_from_file_location("environments_load", REPO / "benchmarks" / "environments_load.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop(spec.name, None)


def test_256_sessions_keep_their_own_state_through_slow_steps_and_a_server_restart(load, tmp_path):
    """Every answer is checked against its session's secret, step count and the call's nonce. The slow steps fail
    as `timeout` and their sessions end (a late answer would otherwise be read as the next step's); the restart,
    while steps are under way, loses every session of before it (`lost`, from that turn or the next: the server's
    environments died with it), never answered by a fresh environment as if it were the same one; the sessions
    opened after it play on; the failure-rate stop does not fire (a restart's lost sessions are not counted)."""
    server = load.LoadServer(free_port(), 2 * SESSIONS, tmp_path)
    try:
        yaml = load.tools_yaml(tmp_path, server.url, REPLY_S, reconnects=5, backoff_s=0.1)
        box = ToolBox(ToolSettings(yaml, None, 2, 3 * REPLY_S, 2048, 512, calls_per_worker=SESSIONS // 2))
        try:
            box.begin_batch()
            run = load.LoadRun(box)
            new = load.play(run, server, SESSIONS, 6, SLOW, REPLY_S + 1.0)
            releases = run.release()
            stop = load.failure_rate_stop(box)  # ToolError's first line past episode.max_tool_failure_rate
        finally:
            box.close()
    finally:
        server.stop()
    assert run.mixed == []
    assert stop is None
    old = run.sessions[:SESSIONS]
    assert all(s.steps >= 3 for s in old[SLOW:]) and all(s.steps == 1 for s in old[:SLOW])  # each played first
    assert [s.ended for s in old[:SLOW]] == ["timeout"] * SLOW
    assert Counter(s.ended for s in old[SLOW:]) == {"lost": SESSIONS - SLOW}
    assert run.turns[2]["failures"] == {None: SESSIONS - SLOW, "lost": SLOW}  # a timed-out session is not used again
    assert run.turns[3]["failures"]["lost"] >= 4  # the restart found steps under way (the held ones at least)
    assert len(new) == SESSIONS // 4 and all((s.ended, s.steps) == (None, 2) for s in new)
    assert set(run.failures) == {"timeout", "lost"} and run.failures["timeout"] == SLOW
    assert Counter(r.failure for r in releases) == {None: SESSIONS + len(new) - SLOW, "lost": SLOW}


def test_a_session_tries_a_server_that_is_away_a_bounded_number_of_times_and_names_it():
    from rl_tpu.episodes.openenv_tool import Reconnect, RemoteEnvironment, reconnect_setting

    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    environment = RemoteEnvironment(url, 2.0, "game", Reconnect(tries=2, backoff_s=0.05))
    with pytest.raises(ConnectionError, match=f"the OpenEnv server at {url} took no session in 3 tries over"):
        asyncio.run(environment.reset({}))
    assert Reconnect(3, 0.5).waits() == [0.5, 1.0, 2.0]
    with pytest.raises(ValueError, match="reconnects=-1: allowed values are integers >= 0"):
        reconnect_setting({"reconnects": -1})
    with pytest.raises(ValueError, match="reconnect_backoff_s='x': allowed values are numbers >= 0"):
        reconnect_setting({"reconnect_backoff_s": "x"})
