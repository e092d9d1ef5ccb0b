"""OpenEnv environments under load: many episode sessions (`lifetime: episode`) on one real OpenEnv server on
loopback, through the tool workers (`rl_tpu.episodes.tools.ToolBox`), with slow steps and a server restart in the
middle of a step.

Each session holds a secret of its own and counts its steps; every answer echoes the call's nonce, so an answer of
another session, or a late answer of an earlier step, is seen (`mixed`). The turns:

- 1: every session opens (reset) and steps; 2: every session steps, `--slow` of them past the reply deadline
  (`timeout`, their sessions closed); 3: every session steps (the slow steps' late answers arrive meanwhile);
  4: every session steps, a few of them held a second, and the server is killed and started again while they are
  held: every session of before the restart is `lost` (the server's environments died with it), from this turn or
  the next; 5 on: the old sessions still step (they stay `lost`), and `--sessions // 4` new ones open on the new
  server and play to the end.

Reports each turn's seconds, answers a second (turn 3's is the headline: every session steps, none slow), and the
latencies (p50, p99) of the calls that succeeded, from the turn's start to the server's answer (per turn, and over
the turns after the first, which opens the sessions); and the failures by kind. `tests/unit/test_environments_load.py`
runs a short version and checks that no answer is mixed up.

    python benchmarks/environments_load.py --sessions 512   # writes results/environments_load.json
    python benchmarks/environments_load.py serve --port 8020  # the server alone (SIGUSR1 restarts it)
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
NAME = "secret"  # the tool's name
HOLD_S = 1.0  # how long the steps of the restart's turn are held, for the restart to find them under way


class Ask(Action):
    nonce: str = Field(description="echoed in the answer")
    delay_s: float = Field(0.0, description="seconds the step takes")


class Answer(Observation):
    secret: str = ""  # the session's, from its reset
    steps: int = 0  # steps of this session so far
    nonce: str = ""  # the step's action's
    served_at: float = 0.0  # when the server answered (time.time())


class SecretEnvironment(Environment[Ask, Answer, State]):
    """A session's secret and its step count: any answer shows whose session it came from and which step."""

    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self._state, self._secret = State(), ""

    def reset(self, seed=None, episode_id=None, secret="", **kwargs) -> Answer:
        self._state, self._secret = State(episode_id=episode_id), secret
        return Answer(secret=secret)

    def step(self, action: Ask, timeout_s=None, **kwargs) -> Answer:
        if action.delay_s:
            if markers := os.environ.get("LOAD_MARKERS"):  # says a slow step is under way
                Path(markers, "held").touch()
            time.sleep(action.delay_s)  # in the session's own thread on the server: the others go on
        self._state.step_count += 1
        return Answer(secret=self._secret, steps=self._state.step_count, nonce=action.nonce, served_at=time.time())

    @property
    def state(self) -> State:
        return self._state


def serve(port: int, sessions: int) -> None:
    """The server in a child process, killed (SIGKILL: its sessions die unclosed) and forked again at each SIGUSR1,
    so that a restart takes milliseconds, not an interpreter's start; SIGTERM ends both."""
    import ctypes

    import uvicorn
    from openenv.core.env_server.http_server import create_fastapi_app

    ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: dies with whoever started it

    def config() -> uvicorn.Config:  # a fresh app: no session of the server before
        app = create_fastapi_app(SecretEnvironment, Ask, Answer, max_concurrent_envs=sessions)
        return uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical", backlog=4 * sessions)

    config().load()  # imports what uvicorn imports at its start, before the forks
    child, stopping = 0, False

    def restart(*_) -> None:
        os.kill(child, signal.SIGKILL)

    def stop(*_) -> None:
        nonlocal stopping
        stopping = True
        os.kill(child, signal.SIGKILL)

    signal.signal(signal.SIGUSR1, restart)
    signal.signal(signal.SIGTERM, stop)
    while not stopping:
        child = os.fork()
        if child == 0:
            signal.signal(signal.SIGUSR1, signal.SIG_DFL)
            signal.signal(signal.SIGTERM, signal.SIG_DFL)
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)
            uvicorn.Server(config()).run()
            os._exit(0)
        os.waitpid(child, 0)


class LoadServer:
    """`serve` in a subprocess on `port`: up, restarted, stopped."""

    def __init__(self, port: int, sessions: int, markers: Path):
        self.url, self.markers = f"http://127.0.0.1:{port}", markers
        env = {**os.environ, "LOAD_MARKERS": str(markers)}
        command = [sys.executable, str(HERE / "environments_load.py"), "serve", "--port", str(port)]
        self.process = subprocess.Popen([*command, "--sessions", str(sessions)], env=env)
        self.wait_up(60.0)

    def wait_up(self, within_s: float) -> None:
        deadline = time.monotonic() + within_s
        while True:
            try:
                urllib.request.urlopen(f"{self.url}/health", timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"the OpenEnv load server at {self.url} was not up within {within_s:g} s")
                time.sleep(0.1)

    def restart_when_held(self, within_s: float) -> Callable[[], None]:
        """Restarts the server, from a thread, once one of its steps is held (a step under way); returns what waits
        for that thread and raises what stopped it."""
        (self.markers / "held").unlink(missing_ok=True)
        failed: list[str] = []

        def watch() -> None:
            deadline = time.monotonic() + within_s
            while not (self.markers / "held").exists():
                if time.monotonic() > deadline:
                    failed.append(f"no held step on the OpenEnv load server at {self.url} within {within_s:g} s")
                    return
                time.sleep(0.01)
            self.process.send_signal(signal.SIGUSR1)

        thread = threading.Thread(target=watch, name="restart", daemon=True)
        thread.start()

        def joined() -> None:
            thread.join()
            if failed:
                raise RuntimeError(failed[0])

        return joined

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def tools_yaml(folder: Path, url: str, reply_s: float, reconnects: int, backoff_s: float) -> str:
    config = {"type": "native", "base_url": url, "name": NAME, "lifetime": "episode", "timeout_s": reply_s}
    config |= {"reconnects": reconnects, "reconnect_backoff_s": backoff_s, "description": "Ask for the secret."}
    entry = {"class_name": "rl_tpu.episodes.openenv_tool.OpenEnvTool", "config": config}
    (folder / "tools.yaml").write_text(json.dumps({"tools": [entry]}))  # JSON is YAML
    return str(folder / "tools.yaml")


@dataclass
class Session:
    key: str
    secret: str
    steps: int = 0  # its steps answered
    ended: str | None = None  # the kind of its first failure


@dataclass
class LoadRun:
    """Sessions played turn by turn through a ToolBox, every answer checked against its session."""

    box: object  # rl_tpu.episodes.tools.ToolBox
    sessions: list[Session] = field(default_factory=list)
    failures: Counter = field(default_factory=Counter)  # by kind
    mixed: list[str] = field(default_factory=list)  # answers of another session or step
    latencies: list[float] = field(default_factory=list)
    turns: list[dict] = field(default_factory=list)

    def open(self, count: int) -> list[Session]:
        new = [Session(f"s{len(self.sessions) + i}", uuid.uuid4().hex) for i in range(count)]
        self.sessions += new
        return new

    def turn(self, delays: dict[str, float] | None = None) -> dict[str, str | None]:
        """Every session steps once (`delays`: seconds some of the steps take); each session's outcome, by key."""
        from rl_tpu.episodes.tool_worker import ToolCall

        delays, nonces = delays or {}, {s.key: uuid.uuid4().hex for s in self.sessions}
        calls = [
            ToolCall(
                NAME,
                json.dumps({"nonce": nonces[s.key], "delay_s": delays.get(s.key, 0.0)}),
                {"secret": s.secret},
                s.key,
                may_create=s.steps == 0,
            )
            for s in self.sessions
        ]
        start, latencies = time.time(), []
        results, seconds = self.box.run(calls)
        outcomes = {}
        for session, result in zip(self.sessions, results):
            outcomes[session.key] = result.failure
            if result.failure:
                self.failures[result.failure] += 1
                session.ended = session.ended or result.failure
                continue
            answer = json.loads(result.text)
            expected = {"secret": session.secret, "steps": session.steps + 1, "nonce": nonces[session.key]}
            if {k: answer[k] for k in expected} != expected:
                self.mixed.append(f"{session.key}: expected {expected}, got {answer}")
            session.steps += 1
            latencies.append(answer["served_at"] - start)
        answered = sum(failure is None for failure in outcomes.values())
        turn = {"calls": len(calls), "seconds": round(seconds, 3), "answered_per_s": round(answered / seconds, 1)}
        turn["failures"] = Counter(outcomes.values())
        self.turns.append(turn | percentiles(latencies))
        if len(self.turns) > 1:  # the first turn opens the sessions: its latencies are not a step's
            self.latencies += latencies
        return outcomes

    def release(self) -> list:
        from rl_tpu.episodes.tool_worker import ToolRelease

        results, _ = self.box.run([], [ToolRelease(NAME, s.key, s.steps > 0) for s in self.sessions])
        return results

    def figures(self) -> dict:
        calls, seconds = sum(t["calls"] for t in self.turns), sum(t["seconds"] for t in self.turns)
        return {
            "calls": calls,
            "calls_per_s": round(calls / seconds, 1),  # failed calls included: a lost session's fail at once
            "steady_answered_per_s": self.turns[2]["answered_per_s"],  # turn 3: every session steps, none held
            **percentiles(self.latencies),
            "failures": dict(self.failures),
            "mixed": len(self.mixed),
            "turns": [{**t, "failures": {str(k): v for k, v in t["failures"].items()}} for t in self.turns],
        }


def percentiles(latencies: list[float]) -> dict:
    """The median and 99th percentile of a turn's (or the run's) latencies of its calls that succeeded."""
    if not latencies:
        return {}
    ordered = sorted(latencies)
    p99 = ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]
    return {"latency_p50_s": round(statistics.median(ordered), 4), "latency_p99_s": round(p99, 4)}


def play(run: LoadRun, server: LoadServer, sessions: int, turns: int, slow: int, slow_s: float) -> list[Session]:
    """The turns of the module's docstring; the sessions opened after the restart."""
    old = run.open(sessions)
    run.turn()
    run.turn({s.key: slow_s for s in old[:slow]})
    run.turn()  # where a late answer of turn 2 would arrive: read as this step's, were the session kept
    restart = server.restart_when_held(within_s=30.0)
    run.turn({s.key: HOLD_S for s in old[slow : slow + 4]})
    restart()
    new = run.open(max(1, sessions // 4))
    for _ in range(4, turns):
        run.turn()
    return new


def failure_rate_stop(box) -> str | None:
    """The first line of the failure-rate stop's error, had this been a run's batch (None: it would go on)."""
    from rl_tpu.episodes.tools import ToolError

    try:
        box.end_batch()
    except ToolError as err:
        return str(err).splitlines()[0]
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sessions", type=int, default=512, help="episode sessions open at once")
    parser.add_argument("--turns", type=int, default=8, help="turns (at least 5)")
    parser.add_argument("--slow", type=int, default=8, help="steps past the reply deadline, in turn 2")
    parser.add_argument("--reply-s", type=float, default=3.0, help="the tool's reply deadline (config timeout_s)")
    parser.add_argument("--workers", type=int, default=2, help="tool workers")
    parser.add_argument("--out", type=Path, default=HERE / "results" / "environments_load.json")
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from record import write_record  # beside this script

    from rl_tpu.episodes.tools import ToolBox, ToolSettings

    logging.getLogger("rl_tpu.episodes.tools").setLevel(logging.ERROR)  # a line per failed call: hundreds here
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory() as folder:
        server = LoadServer(free_port(), 2 * args.sessions, Path(folder))
        try:
            yaml = tools_yaml(Path(folder), server.url, args.reply_s, reconnects=5, backoff_s=0.1)
            per_worker = -(-args.sessions // args.workers)
            settings = ToolSettings(yaml, None, args.workers, 3 * args.reply_s, 2048, 512, calls_per_worker=per_worker)
            box = ToolBox(settings)
            try:
                box.begin_batch()
                run = LoadRun(box)
                play(run, server, args.sessions, args.turns, args.slow, args.reply_s + 1.0)
                releases = run.release()
                stop = failure_rate_stop(box)
            finally:
                box.close()
        finally:
            server.stop()
    figures = run.figures()
    figures["release_failures"] = dict(Counter(r.failure for r in releases if r.failure))
    figures["failure_rate_stop"] = stop
    print(json.dumps({k: v for k, v in figures.items() if k != "turns"}))
    write_record(args.out, load_before, sessions=args.sessions, turns_per_session=args.turns, **figures)


if __name__ == "__main__":
    if sys.argv[1:2] == ["serve"]:
        parser = argparse.ArgumentParser(description="the load server alone")
        parser.add_argument("--port", type=int, required=True)
        parser.add_argument("--sessions", type=int, default=1024)
        args = parser.parse_args(sys.argv[2:])
        serve(args.port, args.sessions)
    else:
        main()
