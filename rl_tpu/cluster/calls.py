"""Waiting on actors with a deadline, and errors that name the actor.

Every wait on an actor goes through `gather`: it returns as soon as every call has answered,
raises at the first failure (so a rank that raised is reported at once, not after its peers
time out in a collective; within a 2 s grace, a peer's death that broke its collective is reported
instead, which a restart repairs), and stops after `timeout_s` naming who did not answer. A wait that runs
far longer than its kind took before is logged on the way, naming who has not answered: a hang (ranks whose
collectives disagree, a stuck device) shows within minutes, not at a deadline an hour away.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import Any, Sequence

from rl_tpu.cluster.actor_logs import log_path

log = logging.getLogger(__name__)
NOTICE_AFTER_S = 120.0  # a wait is logged once it is this long and NOTICE_FACTOR times its kind's longest so far
NOTICE_FACTOR = 5.0
_longest_s: dict[str, float] = {}  # the longest answered wait of each kind (`what`, its numbers left out)


class ActorError(RuntimeError):
    """An actor raised, died, or did not answer in time; the message names it and its log file.

    `lost` is true when the actor's process is gone (killed, crashed, its node lost): what a restart
    can repair, unlike an exception the actor raised or a deadline it missed.
    """

    def __init__(self, message: str, actor: str | None = None, lost: bool = False):
        super().__init__(message)
        self.actor, self.lost = actor, lost


def gather(
    calls: Sequence[tuple[str, Any]],
    what: str,
    timeout_s: float,
    log_dir: str | Path | None = None,
    notice_after_s: float = NOTICE_AFTER_S,
) -> list:
    """`ray.get` of `(actor name, ObjectRef)` pairs, in order, within `timeout_s` for all of them. A wait past
    `notice_after_s` and NOTICE_FACTOR times the longest of its kind is logged, and again each time it doubles."""
    import ray
    from ray.exceptions import RayActorError, RayError, RayTaskError

    names = {ref: name for name, ref in calls}
    pending, results = [ref for _, ref in calls], {}
    kind = re.sub(r"\d+", "#", what)  # "installing weights v3" and v4 are one kind of wait
    started = time.monotonic()
    deadline = started + timeout_s
    notice = started + max(notice_after_s, NOTICE_FACTOR * _longest_s.get(kind, 0.0))
    while pending:
        wake = min(deadline, notice)
        ready, pending = ray.wait(pending, num_returns=1, timeout=max(0.0, wake - time.monotonic()))
        if not ready and time.monotonic() < deadline:  # not an answer yet, and not late: say who is awaited
            _notice_waiting(
                what, kind, started, deadline, ", ".join(names[r] for r in pending) + _logs(pending, names, log_dir)
            )
            notice = started + 2 * (notice - started)
            continue
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
    _longest_s[kind] = max(_longest_s.get(kind, 0.0), time.monotonic() - started)
    return [results[ref] for _, ref in calls]


def _notice_waiting(what: str, kind: str, started: float, deadline: float, waiting: str) -> None:
    now = time.monotonic()
    before = f"; it took {_longest_s[kind]:.1f} s at most before" if kind in _longest_s else ""
    log.warning(
        "%s: still waiting for %s after %.0f s%s; its deadline is in %.0f s",
        what,
        waiting,
        now - started,
        before,
        deadline - now,
    )


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
