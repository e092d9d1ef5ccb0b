"""A pool's lost engines brought back in place: Ray restarts the actor, the pool gives it the served weights.

A lost engine (its process killed or crashed) is brought back when the pool has an `EngineRecovery`: Ray restarts
the actor in its bundle (its `max_restarts` option), the engine is given the weights the other engines serve, and
the lost call is sent again. A prompt carries its own seed, so the replacement draws the same tokens the lost engine
would have: no sample is lost. Each engine's restart count (its life) tells a call sent before a restart from one
sent after, so that one loss is recovered once however many calls it failed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Callable

from rl_tpu.cluster.actor_logs import actor_name
from rl_tpu.cluster.calls import ActorError, gather
from rl_tpu.records import WeightBundle

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineRecovery:
    """What bringing back a lost engine needs beside Ray's restart of its process."""

    republish: Callable[[int], WeightBundle]  # the trainer's current weights, as version N
    max_restarts: int  # per engine (Ray's `max_restarts` of the actor)
    ready_timeout_s: float  # a restarted engine loads its model again


@dataclass
class EngineRestarts:
    """The restart-in-place of a pool's engines, and how often each was brought back."""

    engines: list  # the pool's Ray actor handles of `Sampler`, engine order (the pool's own list)
    log_dir: str | None = None
    recovery: EngineRecovery | None = None  # None: a lost engine ends the call with an error
    lives: dict[int, int] = field(default_factory=dict)  # engine -> times it was brought back

    @property
    def count(self) -> int:
        """Restarts over all engines (the `sampler/restarts` metric)."""
        return sum(self.lives.values())

    def life(self, engine: int) -> int:
        """The engine's restart count now: a call sent now is answered by this life of it, or lost with it."""
        return self.lives.get(engine, 0)

    def wait(
        self,
        engine: int,
        ref,
        life: int,
        send_again: Callable[[], object],
        what: str,
        deadline: float,
        served: int,
        reinstall: bool = True,
        restarted: Callable[[object], str | None] = lambda answer: None,
    ):
        """The answer of one call on `engine`; if the engine was lost, bring it back (given weights v`served`
        unless the call sent again installs them itself) and send the call again. `restarted(answer)` says why an
        answer shows that Ray restarted the engine before the call reached it."""
        while True:
            try:
                name = actor_name("sampler", engine)
                answer = gather([(name, ref)], what, max(0.0, deadline - time.monotonic()), self.log_dir)[0]
                why = restarted(answer) if self.recovery else None
                if why is None:
                    return answer
            except ActorError as err:
                if not (err.lost and self.recovery):
                    raise
                why = str(err).splitlines()[0]
            self.bring_back(engine, life, why, served, reinstall)
            ref, life = send_again(), self.lives[engine]

    def bring_back(self, engine: int, life: int, why: str, served: int, reinstall: bool = True) -> None:
        """Wait for Ray's restart of a lost engine and give it the served weights, v`served` (once per loss)."""
        if self.life(engine) != life:
            return  # another call on the same engine already brought it back
        name, recovery = actor_name("sampler", engine), self.recovery
        log.warning("%s was lost (%s); waiting for Ray to restart it", name, why)
        self._until_restarted(
            engine, f"restarting {name} (restart {life + 1} of sampler.max_restarts={recovery.max_restarts})"
        )
        if reinstall and served > 0:
            gather(
                [(name, self.engines[engine].install.remote(recovery.republish(served)))],
                f"installing weights v{served} in the restarted {name}",
                recovery.ready_timeout_s,
                self.log_dir,
            )
        self.lives[engine] = life + 1
        log.warning(
            "%s restarted (restart %d of sampler.max_restarts=%d), serving weights v%d; its lost call is sent again",
            name,
            life + 1,
            recovery.max_restarts,
            served,
        )

    def _until_restarted(self, engine: int, what: str) -> None:
        """Wait for the engine's constructor to finish again; raises once Ray gives up on it (restarts spent)."""
        from ray.exceptions import ActorUnavailableError

        name, deadline = actor_name("sampler", engine), time.monotonic() + self.recovery.ready_timeout_s
        while True:
            try:
                gather(
                    [(name, self.engines[engine].__ray_ready__.remote())],
                    what,
                    max(0.0, deadline - time.monotonic()),
                    self.log_dir,
                )
                return
            except ActorError as err:  # calls made while Ray restarts the actor fail at once: ask again
                if not isinstance(err.__cause__, ActorUnavailableError) or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
