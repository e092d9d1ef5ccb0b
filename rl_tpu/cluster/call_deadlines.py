"""Deadlines for the calls a worker process runs at once on its event loop (`rl_tpu.episodes.tool_worker`).

Three ways a call can outlive its deadline, and what each gets:

- it awaits too long (a server that never answers): it is cancelled at its deadline (`asyncio.timeout`), and the
  worker, its other calls and what it holds go on;
- it blocks the event loop (`time.sleep` or a synchronous client inside an async tool), which freezes every call
  of the worker: a watchdog thread sees the loop stop and interrupts the main thread with a signal, whose handler
  raises `CallBlocked` in the code holding the loop, so that this call fails and the others resume with the
  time they lost added to their deadlines (code that does not return to Python, such as a C extension's long
  loop, is not reached: the pool's deadline, a little later, replaces the worker);
- it runs in a thread (verl runs a synchronous function tool in one, as `asyncio.to_thread` does), which nothing
  can stop: the call's threads are tracked, and `stuck` says so, for the worker to leave the call unanswered and
  the pool to replace it.
"""

from __future__ import annotations

import asyncio
import contextvars
import ctypes
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Awaitable, TypeVar

T = TypeVar("T")
TICK_S = 0.25  # how often the loop notes that it runs, and the watchdog looks
INTERRUPT = signal.SIGUSR1
# the pool waits this much longer than a call's deadline before it replaces a silent worker: time for the
# watchdog to interrupt a blocked call and for its answer to arrive
POOL_GRACE_S = 5.0

M_ARENA_MAX = -8  # glibc's malloc.h

_CALL_THREADS: contextvars.ContextVar[set[Future] | None] = contextvars.ContextVar("call_threads", default=None)


class CallTimeout(RuntimeError):
    """A call ran past its deadline."""


class CallBlocked(BaseException):
    """Raised by the watchdog's signal in code that held the event loop past a call's deadline. A BaseException,
    as `asyncio.CancelledError` is, so that a tool's `except Exception` does not swallow it."""


class CallThreads(ThreadPoolExecutor):
    """The event loop's default executor: each piece of work is noted in the set of the call that started it."""

    def submit(self, fn, /, *args, **kwargs) -> Future:
        future = super().submit(fn, *args, **kwargs)
        started = _CALL_THREADS.get()
        if started is not None:
            started.add(future)
        return future


def one_heap() -> None:
    """Threads allocate from the main heap (glibc): a heap of its own reserves 64 MB of address space per thread,
    which counts against the worker's memory limit (RLIMIT_AS) although little of it is used."""
    if sys.platform.startswith("linux"):
        ctypes.CDLL(None).mallopt(M_ARENA_MAX, 1)


class Deadlines:
    """Each call's deadline on `loop` (its default executor, a signal handler and a watchdog thread are set up
    here: build it in the main thread, once per process)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, timeout_s: float, threads: int):
        self.loop, self.timeout_s = loop, timeout_s
        self.beat = time.monotonic()  # when the loop last ran its tick
        self.interrupted: float | None = None  # the beat after which the watchdog last signalled
        self.active: set[asyncio.Timeout] = set()  # the deadlines of the calls under way
        one_heap()
        loop.set_default_executor(CallThreads(max_workers=threads, thread_name_prefix="call"))
        signal.signal(INTERRUPT, self._interrupt)
        loop.call_soon(self._tick)
        threading.Thread(target=self._watch, name="call deadlines", daemon=True).start()

    def track(self) -> set[Future]:
        """The threads the current task starts from now (call at the start of each call's task)."""
        threads: set[Future] = set()
        _CALL_THREADS.set(threads)
        return threads

    @staticmethod
    def stuck(threads: set[Future]) -> bool:
        """Whether work a call started in a thread still runs (after its deadline: it cannot be stopped)."""
        return any(not future.done() for future in threads)

    async def run(self, work: Awaitable[T]) -> T:
        """`work`'s result, or `CallTimeout` once it passed the deadline (cancelled, or interrupted while it held
        the loop). A tool's own TimeoutError passes through as it is."""
        deadline = asyncio.timeout(self.timeout_s)
        self.active.add(deadline)
        try:
            async with deadline:
                return await work
        except TimeoutError:
            if not deadline.expired():
                raise
        except CallBlocked:
            pass
        finally:
            self.active.discard(deadline)
        raise CallTimeout(f"no answer within {self.timeout_s:g} s")

    def _tick(self) -> None:
        """Note that the loop runs. After it was held past a deadline (by a call, interrupted by now, or by the
        worker's own send), the calls that waited get the time back: only the one that held it times out."""
        now = time.monotonic()
        if now - self.beat > self.timeout_s:
            for deadline in [d for d in self.active if not d.expired()]:
                deadline.reschedule(deadline.when() + now - self.beat)
        self.beat = now
        self.loop.call_later(TICK_S, self._tick)

    def _watch(self) -> None:
        main = threading.main_thread().ident
        while True:
            time.sleep(TICK_S)
            beat = self.beat
            if beat != self.interrupted and time.monotonic() - beat > self.timeout_s:
                self.interrupted = beat
                signal.pthread_kill(main, INTERRUPT)

    def _interrupt(self, signum: int, frame) -> None:
        """In the main thread, in the code that holds the loop. Nothing happens if the loop ticked since the
        watchdog looked, or is not running (the worker is between jobs, in its own code)."""
        if self.beat != self.interrupted:
            return
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            return
        if running is self.loop:
            raise CallBlocked(f"held the worker's event loop for more than {self.timeout_s:g} s")
