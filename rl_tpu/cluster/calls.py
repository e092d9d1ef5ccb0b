"""Waiting on actors with a deadline, and errors that name the actor.

Every wait on an actor goes through `gather`: it returns as soon as every call has answered,
raises at the first failure (so a rank that raised is reported at once, not after its peers
time out in a collective; within a 2 s grace, a peer's death that broke its collective is reported
instead, which a restart repairs), and stops after `timeout_s` naming who did not answer.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Sequence

from rl_tpu.cluster.actor_logs import log_path


class ActorError(RuntimeError):
    """An actor raised, died, or did not answer in time; the message names it and its log file.

    `lost` is true when the actor's process is gone (killed, crashed, its node lost): what a restart
    can repair, unlike an exception the actor raised or a deadline it missed.
    """

    def __init__(self, message: str, actor: str | None = None, lost: bool = False):
        super().__init__(message)
        self.actor, self.lost = actor, lost


def gather(calls: Sequence[tuple[str, Any]], what: str, timeout_s: float, log_dir: str | Path | None = None) -> list:
    """`ray.get` of `(actor name, ObjectRef)` pairs, in order, within `timeout_s` for all of them."""
    import ray
    from ray.exceptions import RayActorError, RayError, RayTaskError

    names = {ref: name for name, ref in calls}
    pending, results = [ref for _, ref in calls], {}
    deadline = time.monotonic() + timeout_s
    while pending:
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, deadline - time.monotonic()))
        if not ready:
            waiting = ", ".join(names[ref] for ref in pending)
            raise ActorError(f"{what}: no answer from {waiting} within {timeout_s:g} s{_logs(pending, names, log_dir)}")
        ref = ready[0]
        try:
            results[ref] = ray.get(ref)
        except RayActorError as err:  # also a call that waited on the actor's earlier call (`SamplerPool.generate`)
            raise ActorError(
                f"{what}: {names[ref]} died{_logs([ref], names, log_dir)}: {err}", names[ref], lost=True
            ) from err
        except RayTaskError as err:
            # a rank whose collective broke because a peer died raises too, often before Ray reports the death:
            # a lost peer is what a restart repairs, so it is the error reported
            dead = _died_meanwhile(pending, PEER_DEATH_GRACE_S)
            if dead is not None:
                raise ActorError(
                    f"{what}: {names[dead]} died{_logs([dead], names, log_dir)} ({names[ref]} failed with it)",
                    names[dead],
                    lost=True,
                ) from err
            raise ActorError(
                f"{what} failed in {names[ref]}{_logs([ref], names, log_dir)}:\n{err}", names[ref]
            ) from err
        except RayError as err:  # e.g. OutOfMemoryError: Ray's memory monitor killed the actor's worker
            raise ActorError(
                f"{what}: {names[ref]} was stopped by Ray ({type(err).__name__}){_logs([ref], names, log_dir)}: {err}",
                names[ref],
            ) from err
    return [results[ref] for _, ref in calls]


PEER_DEATH_GRACE_S = 2.0  # how long a failed call's peers are watched for a death that caused the failure


def _died_meanwhile(pending: list, grace_s: float):
    """The first of the `pending` calls whose actor died, within `grace_s`; None if none did."""
    import ray
    from ray.exceptions import RayActorError

    if not pending:
        return None
    ready, _ = ray.wait(pending, num_returns=len(pending), timeout=grace_s)
    for ref in ready:
        try:
            ray.get(ref)
        except RayActorError:
            return ref
        except Exception:  # another failure of its own: not a death
            continue
    return None


def _logs(refs, names: dict, log_dir: str | Path | None) -> str:
    if not log_dir:
        return ""
    return " (see " + ", ".join(str(log_path(log_dir, names[ref])) for ref in refs) + ")"
