"""Worker processes for user code (reward functions, tools): every job has a deadline, and a worker that runs past
it or dies is killed and replaced; its job fails, never the run (a replacement that cannot start leaves its place
down for a while: `_Down`).

A worker is ``python -m MODULE READ_FD WRITE_FD`` speaking `multiprocessing.connection` messages over two
pipes (its stdout stays free for the user's prints); the module's ``__main__`` calls `serve`. Protocol: the pool
sends ``(setup, WorkerLimits)``; the worker answers ``("ready", detail)`` or ``("load_error", traceback)``; then
per job ``(positions, items)`` it answers with messages ``[(position, outcome), ...]``: one per item, or one for
the whole job (a batched worker).

Why not `concurrent.futures.ProcessPoolExecutor` or Ray tasks: neither can kill the one worker whose job hangs
and go on with the others (a hung future can only be abandoned), and Ray tasks would put user code beside
the run's actors. Workers die with the process that started them (`die_with_parent`).
"""

from __future__ import annotations

import asyncio
import ctypes
import io
import logging
import math
import os
import resource
import signal
import subprocess
import sys
import time
import traceback
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection
from typing import Any, Awaitable, Callable, Iterable

from rl_tpu.cluster.pool_run import PoolRun

log = logging.getLogger(__name__)

START_TIMEOUT_S = 120
# A worker that cannot be replaced (its code no longer loads, its server is unreachable) leaves its place down: the
# place is tried again after RESTART_BACKOFF_S, doubling, and given up after MAX_FAILED_STARTS failed starts in a row
RESTART_BACKOFF_S = 1.0
MAX_FAILED_STARTS = 5
# What a worker keeps of this process's environment without `pass_env`: enough to run Python and find temporary
# storage, and nothing that usually holds a secret (tokens, keys, passwords).
BASE_ENV = ("PATH", "HOME", "USER", "LANG", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "PYTHONHASHSEED")
PR_SET_PDEATHSIG = 1  # linux/prctl.h


def worker_environment(pass_env: list[str]) -> dict[str, str]:
    kept = {name: os.environ[name] for name in (*BASE_ENV, *pass_env) if name in os.environ}
    # the workers import what this process imports (rewards/, the plugin's own imports)
    return {**kept, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p), "OMP_NUM_THREADS": "1"}


def die_with_parent() -> None:
    """In a worker: be killed when the process that started it dies (Linux), so no worker outlives a killed run."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


def limit_memory(memory_mb: int | None) -> None:
    """From now, at most `memory_mb` more address space than the process holds: what is loaded already (a torch
    built with CUDA maps several GB of libraries, which an absolute limit would refuse) is not counted."""
    if memory_mb is None:
        return
    held_kb = next(int(line.split()[1]) for line in open("/proc/self/status") if line.startswith("VmSize:"))
    limit = held_kb * 2**10 + memory_mb * 2**20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))


def limit_cpu(per_item_s: float | None, items: int) -> None:
    """From now, at most `per_item_s * items` more CPU seconds (the soft limit moves with each job)."""
    if per_item_s is None:
        return
    usage = resource.getrusage(resource.RUSAGE_SELF)
    used = usage.ru_utime + usage.ru_stime
    hard = resource.getrlimit(resource.RLIMIT_CPU)[1]
    soft = math.ceil(used + per_item_s * items)
    resource.setrlimit(resource.RLIMIT_CPU, (soft if hard == resource.RLIM_INFINITY else min(soft, hard), hard))


@dataclass(frozen=True)
class WorkerLimits:
    memory_mb: int | None = None  # RLIMIT_AS of the worker process; None: unlimited
    cpu_s_per_item: float | None = None  # RLIMIT_CPU budget of each job, per item in it; None: unlimited
    output_bytes: int = 2**20  # what the worker's code may print (stdout and stderr together); the rest is dropped


class CappedOutput(io.TextIOBase):
    """A text stream that passes on what is written until a budget shared with its siblings is spent, then one line
    saying so: user code that prints without bound cannot flood the run's output or fill its disk."""

    def __init__(self, stream, budget: list[int]):
        self.stream, self.budget = stream, budget  # budget: [characters left], shared by stdout and stderr

    def write(self, text: str) -> int:
        if self.budget[0] > 0:
            self.stream.write(text[: self.budget[0]])
            self.budget[0] -= len(text)
            if self.budget[0] <= 0:
                self.stream.write("\n[rl_tpu: this worker printed more than its limit; the rest is dropped]\n")
            self.stream.flush()
        return len(text)

    def flush(self) -> None:
        self.stream.flush()


def cap_output(limit: int) -> None:
    budget = [limit]
    sys.stdout, sys.stderr = CappedOutput(sys.stdout, budget), CappedOutput(sys.stderr, budget)


def _start_serving(load: Callable[[Any], tuple[Any, Any]]):
    """A worker's start: it dies with its parent, caps its output, loads its code and bounds the address space it may
    add; returns its pipes, state and limits, or None when loading failed (the traceback went back)."""
    inbox = Connection(int(sys.argv[1]), writable=False)
    outbox = Connection(int(sys.argv[2]), readable=False)
    die_with_parent()
    setup, limits = inbox.recv()
    cap_output(limits.output_bytes)
    try:
        state, detail = load(setup)
    except Exception:
        outbox.send(("load_error", traceback.format_exc()))
        return None
    limit_memory(limits.memory_mb)
    outbox.send(("ready", detail))
    return inbox, outbox, state, limits


def serve(
    load: Callable[[Any], tuple[Any, Any]],
    answer: Callable[[Any, list[int], list, asyncio.AbstractEventLoop], Iterable[list]],
) -> None:
    """A worker's side of the protocol (its ``__main__``). It dies with its parent and bounds itself by the setup's
    `WorkerLimits`: its output from the start; once its code is loaded, the address space it may add, so that an
    item that allocates without bound fails with MemoryError instead of taking the host down, and the CPU seconds
    of each job (SIGXCPU ends the worker, which the pool sees as a crash). `load(setup)` returns the worker's state and its ready detail (or raises:
    the traceback goes back as the load error); `answer(state, positions, items, loop)` yields the messages of one
    job, each a list of ``(position, outcome)``."""
    started = _start_serving(load)
    if started is None:
        return
    inbox, outbox, state, limits = started
    loop = asyncio.new_event_loop()  # for async user code (verl's tools, async reward functions)
    while True:
        try:
            positions, items = loop.run_until_complete(next_job(inbox))
        except EOFError:  # the pool closed its end: shut down
            return
        limit_cpu(limits.cpu_s_per_item, len(items))
        for message in answer(state, positions, items, loop):
            outbox.send(message)


def serve_concurrently(
    load: Callable[[Any], tuple[Any, Any]],
    answer_item: Callable[[Any, Any, asyncio.AbstractEventLoop], Awaitable[Any]],
) -> None:
    """`serve` for a worker whose items are tasks on its event loop: it reads each job as it arrives, while the
    items of earlier ones run (a pool's `stream` sends a busy worker more), and answers each item as it ends.
    `answer_item(state, item, loop)` is an item's outcome, or None for one it leaves unanswered (the pool's deadline
    then replaces the worker). The CPU-seconds bound counts the items not yet answered."""
    started = _start_serving(load)
    if started is None:
        return
    inbox, outbox, state, limits = started
    running: set[asyncio.Task] = set()

    async def one(position: int, item: Any) -> None:
        outcome = await answer_item(state, item, asyncio.get_running_loop())
        if outcome is not None:
            outbox.send([(position, outcome)])

    async def main() -> None:
        while True:
            try:
                positions, items = await next_job(inbox)
            except EOFError:  # the pool closed its end: shut down
                return
            limit_cpu(limits.cpu_s_per_item, len(running) + len(items))
            for position, item in zip(positions, items):
                task = asyncio.ensure_future(one(position, item))
                running.add(task)
                task.add_done_callback(running.discard)

    asyncio.new_event_loop().run_until_complete(main())


async def next_job(inbox: Connection) -> Any:
    """The next job, read once it arrives, the event loop running meanwhile: what user code keeps on it between
    jobs goes on (a WebSocket client answers its server's keep-alive pings; a blocking read would leave the
    connection silent until the next job, and a server that pings closes it)."""
    loop = asyncio.get_running_loop()
    arrived = loop.create_future()
    loop.add_reader(inbox.fileno(), lambda: arrived.done() or arrived.set_result(None))
    try:
        await arrived
    finally:
        loop.remove_reader(inbox.fileno())
    return inbox.recv()


@dataclass
class _Worker:
    process: subprocess.Popen
    inbox: Connection  # what the worker sends us
    outbox: Connection  # what we send the worker
    detail: Any  # what its ready message said
    in_flight: deque = field(default_factory=deque)  # positions sent and not yet answered
    deadline: float = math.inf
    source: deque | None = None  # the queue its share came from (where the unanswered rest goes back)


@dataclass
class _Down:
    """A place whose worker could not be started again (its code no longer loads, its server is unreachable): its
    items fail at once, as "unavailable", while it waits RESTART_BACKOFF_S, doubling, for the next start, and after
    MAX_FAILED_STARTS failed starts in a row it is given up. A run stops when its failure rate says so, not at the
    first worker that could not be replaced."""

    error: str  # why the last start failed
    failed_starts: int  # in a row
    retry_at: float  # `time.monotonic()` of the next try; inf once MAX_FAILED_STARTS are spent

    @classmethod
    def after(cls, error: str, previous: _Worker | _Down) -> _Down:
        failed_starts = previous.failed_starts + 1 if isinstance(previous, _Down) else 1
        backoff = RESTART_BACKOFF_S * 2 ** (failed_starts - 1)
        return cls(error, failed_starts, math.inf if failed_starts >= MAX_FAILED_STARTS else time.monotonic() + backoff)

    def due(self) -> bool:
        return time.monotonic() >= self.retry_at

    def message(self, what: str) -> str:
        tries = f"{self.failed_starts} of {MAX_FAILED_STARTS} starts failed in a row"
        then = "given up" if self.retry_at == math.inf else "tried again later"
        return f"{what} could not be started again ({tries}; {then}):\n{self.error}"


def _stop(worker: _Worker, kill: bool = False) -> None:
    """Ends a worker: EOF on its inbox, or killed."""
    worker.outbox.close()  # a worker waiting for work exits on EOF
    if kill:
        worker.process.kill()
    try:
        worker.process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        worker.process.kill()
        worker.process.wait()
    worker.inbox.close()


class WorkerPool:
    """`count` workers of `module`; `run` spreads items over them with a deadline of `timeout_s` per item."""

    def __init__(
        self,
        module: str,
        setup: Any,
        count: int,
        env: dict[str, str],
        timeout_s: float,
        what: str,
        error: Callable[[str], Exception],
        log_path: str | None = None,
    ):
        """`what` names the workers in errors ("reward worker for gsm8k"); `error` makes the exception raised when
        one cannot start at first (its message given; a replacement that cannot start fails its items instead);
        `log_path`: the file the workers' output is appended to (None: this process's stdout)."""
        self.module, self.setup, self.env, self.timeout_s = module, setup, env, timeout_s
        self.what, self.error, self.log_path = what, error, log_path
        self.workers: list[_Worker | _Down] = [self._spawn() for _ in range(count)]
        self.detail = self.workers[0].detail  # what the workers' ready message said (the same for every worker)
        self.closed = False  # set by close(), which another thread may call while `run` waits on the workers
        self.running = False

    @property
    def size(self) -> int:
        return len(self.workers)

    @property
    def live(self) -> list[_Worker]:
        return [w for w in self.workers if isinstance(w, _Worker)]

    def busy_workers(self) -> int:
        """How many live workers hold items sent and not yet answered."""
        return sum(bool(worker.in_flight) for worker in self.live)

    def cpu_seconds(self) -> float:
        """The CPU time the live workers have used so far (user and system): a caller that samples it twice sees
        whether they compute or wait."""
        import psutil

        total = 0.0
        for worker in self.live:
            try:
                times = psutil.Process(worker.process.pid).cpu_times()
            except psutil.Error:  # it just exited: its time is gone with it
                continue
            total += times.user + times.system
        return total

    def down_at(self, place: int) -> _Down | None:
        worker = self.workers[place]
        return worker if isinstance(worker, _Down) else None

    def run(
        self,
        items: list,
        batched: bool,
        failed: Callable[[str, str], Any],
        shares_per_worker: int = 4,
        give_up: Callable[[list], bool] | None = None,
        route: Callable[[Any], int | None] | None = None,
        concurrent: bool = False,
    ) -> list:
        """Every item's outcome, in order. `failed(kind, message)` is the outcome of an item whose worker timed out
        ("timeout") or died ("crash"), or whose place is `_Down` ("unavailable"). Batched workers get one share each
        and a deadline per item in it; the others get small shares (`shares_per_worker` each), so that the load
        balances, and answer item by item.

        `give_up(outcomes)`, asked as answers arrive (None where there is none yet), stops the run early: the busy
        workers are replaced and every item without an answer gets `failed("cancelled", ...)`.

        `route(item)`, where given, pins an item to a worker (any int, taken modulo the pool's size; None: any
        worker): items that need what an earlier item left in a worker's memory go where it went, in order. A worker
        replaced after a failure keeps its place, not its memory. `concurrent`: a worker runs its share's items at
        once, answering each as it ends; one that dies or goes silent fails all it has not answered."""
        job = PoolRun(self, batched, failed, shares_per_worker, give_up, route, concurrent)
        try:
            job.add(items)
            while not job.finished and not self.closed and not job.given_up:
                job.step(math.inf)
            return job.ending()
        finally:
            job.close()

    def stream(self, failed: Callable[[str, str], Any], route: Callable[[Any], int | None] | None = None) -> PoolRun:
        """A run that takes items while it runs (`PoolRun.add`) and is advanced by its caller (`PoolRun.step`), for
        concurrent workers that read new jobs while they run others (`serve_concurrently`): an item is sent as soon
        as it is added, whatever its worker is running, so one slow item holds no other. One at a time, and never
        beside `run`."""
        return PoolRun(self, False, failed, 1, None, route, concurrent=True, stream=True)

    def _cancel(self) -> None:
        """The busy workers stopped and replaced: what they ran is given up."""
        for worker in [w for w in self.live if w.in_flight]:
            worker.in_flight = deque()
            _stop(worker, kill=True)
            self._replace(self.workers.index(worker))

    def close(self) -> None:
        """Stop every worker. A `run` under way in another thread is not waited for: its workers are killed, and it
        returns at its next wake-up (at once: their pipes close), its unanswered items cancelled."""
        self.closed = True
        if self.running:
            for worker in self.live:
                worker.process.kill()
            return
        self._stop_all()

    def _stop_all(self) -> None:
        for worker in self.live:
            _stop(worker)
        self.workers = []

    def _replace(self, place: int) -> None:
        """A new worker at `place`; one that cannot start leaves the place `_Down`."""
        try:
            self.workers[place] = self._spawn()
        except Exception as err:  # whatever stopped the start: it is the items' failure now
            self.workers[place] = down = _Down.after(str(err), self.workers[place])
            log.warning("%s %s", down.message(self.what).splitlines()[0], str(err).strip().splitlines()[-1])

    def _spawn(self) -> _Worker:
        from_parent, to_child = os.pipe()
        from_child, to_parent = os.pipe()
        log = open(self.log_path, "ab") if self.log_path else None  # the child keeps its own descriptor
        process = subprocess.Popen(
            [sys.executable, "-m", self.module, str(from_parent), str(to_parent)],
            pass_fds=(from_parent, to_parent),
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT if log else None,
        )
        if log:
            log.close()
        os.close(from_parent)
        os.close(to_parent)
        inbox, outbox = Connection(from_child, writable=False), Connection(to_child, readable=False)
        outbox.send(self.setup)
        try:
            if not inbox.poll(START_TIMEOUT_S):
                process.kill()
                raise self.error(f"{self.what} did not start within {START_TIMEOUT_S} s (does importing it hang?)")
            status, detail = inbox.recv()
        except EOFError:
            raise self.error(f"{self.what} exited at start (code {process.wait()})") from None
        if status == "load_error":
            process.wait()
            raise self.error(f"could not load {self.what}:\n{detail}")
        return _Worker(process, inbox, outbox, detail)

    def _send(self, worker: _Worker, source: deque, items: list, batched: bool) -> None:
        """Sends the next share of `source` (a busy concurrent worker adds it to what it runs: its deadline, renewed
        at each answer, stands)."""
        positions = source.popleft()
        if not worker.in_flight:
            worker.deadline = time.monotonic() + self.timeout_s * (len(positions) if batched else 1)
        worker.in_flight.extend(positions)
        worker.source = source
        worker.outbox.send((positions, [items[p] for p in positions]))

    def _lose(self, worker: _Worker, all_unanswered: bool) -> list[int]:
        """A worker timed out or died: the item(s) it was on, which fail (all it had not answered, or the first of
        them for a worker that answers in order); the rest are requeued and the worker replaced."""
        culprits = list(worker.in_flight) if all_unanswered else [worker.in_flight[0]]
        rest = [p for p in worker.in_flight if p not in culprits]
        if rest:
            worker.source.appendleft(rest)
        worker.in_flight = deque()
        _stop(worker, kill=True)
        self._replace(self.workers.index(worker))
        return culprits
