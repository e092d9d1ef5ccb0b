"""Several vLLM engines as one sampler: each batch split between them, every weight version installed in all.

Prompts are split into contiguous chunks of nearly equal size, one per engine, and the rollouts
come back in prompt order with each rollout's `group` the prompt's index in the whole batch.
An install reaches every engine (for the collective transport, all engines take part in the
same broadcast), and every engine must report the same version afterwards and answer the bundle's
canary as the trainer does (`rl_tpu/sync/canary.py`): its answers are held when the install's figures
arrive and checked by `settle_canary`.

A lost engine (its process killed or crashed) is brought back in place when the pool has an
`EngineRecovery` (rl_tpu/sampler/restarts.py), and the lost call is sent again.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import InitVar, dataclass, field

from rl_tpu.cluster.actor_logs import actor_name
from rl_tpu.cluster.calls import gather
from rl_tpu.records import CanaryTokens, Rollout, WeightBundle
from rl_tpu.sampler.engine import SamplingSettings
from rl_tpu.sampler.restarts import EngineRecovery, EngineRestarts
from rl_tpu.sync.canary import CanaryWatch


def split_evenly(count: int, parts: int) -> list[range]:
    """`count` items as `parts` contiguous ranges whose sizes differ by at most one (empty ones dropped)."""
    base, extra = divmod(count, parts)
    ranges, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        ranges.append(range(start, start + size))
        start += size
    return [r for r in ranges if len(r)]


@dataclass
class Chunk:
    """One engine's share of a generation: what it was asked, and the answer under way."""

    engine: int
    prompts: range  # indices in the whole batch
    args: tuple  # the `generate` call's arguments, sent again if the engine is lost
    ref: object
    life: int  # the engine's restart count when the call was sent
    version: int  # the weight version the pool had installed when the call was sent


def _older(rollouts: list[Rollout], version: int) -> str | None:
    """Rollouts from weights older than the engine had been given: Ray restarted it before the call arrived."""
    oldest = min((r.weight_version for r in rollouts), default=version)
    return f"it answered with weights v{oldest}, older than v{version}: restarted by Ray" if oldest < version else None


@dataclass
class PendingRollouts:
    """Generations under way on the engines; `result` waits for all of them and merges in prompt order."""

    pool: "SamplerPool"
    chunks: list[Chunk]

    def result(self, timeout_s: float) -> list[Rollout]:
        deadline = time.monotonic() + timeout_s
        rollouts = []
        for chunk in self.chunks:
            engine = self.pool.engines[chunk.engine]
            part = self.pool.restarts.wait(
                chunk.engine,
                chunk.ref,
                chunk.life,
                lambda: engine.generate.remote(*chunk.args),
                "generate",
                deadline,
                self.pool.version,
                restarted=lambda part: _older(part, chunk.version),
            )
            for rollout in part:
                rollout.group += chunk.prompts.start
            rollouts.extend(part)
        return rollouts

    def shares(self) -> dict[str, float]:
        """Each engine's fraction of the batch's prompts, for the step's metrics."""
        total = sum(len(chunk.prompts) for chunk in self.chunks)
        shares = {f"sampler/engine_{e}/batch_share": 0.0 for e in range(len(self.pool.engines))}
        for chunk in self.chunks:
            shares[f"sampler/engine_{chunk.engine}/batch_share"] = len(chunk.prompts) / total
        return shares


@dataclass
class PendingInstall:
    """An install sent to every engine and not waited for yet (by SamplerPool.start_install)."""

    bundle: WeightBundle
    sent: list[tuple[object, int]]  # per engine: the call's ObjectRef, and the engine's restart count then
    deadline: float
    trainer_canary: list[tuple[str, object]]  # the trainer ranks' canary calls for the bundle (empty: no canary)


@dataclass
class HeldCanary:
    """An install's canary whose engines answered, held until the trainer's score of it is waited for
    (SamplerPool.settle_canary)."""

    version: int
    answers: list  # each engine's
    engine_s: float  # the slowest engine's scoring
    trainer: list[tuple[str, object]]  # the trainer ranks' canary calls, rank 0's first
    deadline: float


@dataclass
class SamplerPool:
    engines: list  # Ray actor handles of `Sampler`, engine order
    log_dir: str | None = None
    recovery: InitVar[EngineRecovery | None] = None  # None: a lost engine ends the call with an error
    version: int = 0  # the newest weight version sent to every engine: generations sent from now on use it
    pending: PendingInstall | None = None
    # at the last install: when it returned, and each engine's busy seconds then (for the idle time between installs)
    last_install: tuple[float, list[float]] | None = None
    # per engine: the generations sent since its last install, which the next install goes in after
    sent_since_install: dict[int, list] = field(default_factory=dict)
    restarts: EngineRestarts = field(init=False)  # lost engines brought back in place (with `recovery`)
    canary: CanaryWatch = field(default_factory=CanaryWatch)  # checks each install's canary answers
    held: HeldCanary | None = None  # the last install's canary, until settle_canary checks it

    def __post_init__(self, recovery: EngineRecovery | None) -> None:
        self.restarts = EngineRestarts(self.engines, self.log_dir, recovery)

    @property
    def names(self) -> list[str]:
        return [actor_name("sampler", i) for i in range(len(self.engines))]

    def generate(
        self,
        prompts: list[list[int]],
        settings: SamplingSettings,
        seeds: list[int] | None = None,
        tools_kwargs: list[dict] | None = None,
    ) -> PendingRollouts:
        """Each engine generates its share; `seeds` and `tools_kwargs` (one per prompt) travel with their prompts.

        Behind an install not waited for yet, each engine's call names that engine's install as an argument, so
        Ray starts it once the install has answered: with the new weights. A call sent again does not."""
        chunks = []
        for engine, part in enumerate(split_evenly(len(prompts), len(self.engines))):
            args = (
                [prompts[i] for i in part],
                settings,
                None if seeds is None else [seeds[i] for i in part],
                None if tools_kwargs is None else [tools_kwargs[i] for i in part],
            )
            after = self.pending.sent[engine][0] if self.pending else None
            ref = self.engines[engine].generate.remote(*args, after=after)
            self.sent_since_install.setdefault(engine, []).append(ref)
            chunks.append(Chunk(engine, part, args, ref, self.restarts.life(engine), self.version))
        return PendingRollouts(self, chunks)

    def call(self, method: str, what: str, timeout_s: float, *args) -> list:
        """The same call on every engine, waited for together."""
        calls = [(name, getattr(engine, method).remote(*args)) for name, engine in zip(self.names, self.engines)]
        return gather(calls, what, timeout_s, self.log_dir)

    def check_canary(
        self, tokens: CanaryTokens, trainer: list[tuple[str, object]], timeout_s: float
    ) -> dict[str, float]:
        """Every engine scores `tokens` under what it serves now (at start: version 0, before the first evaluation),
        checked against the trainer ranks' canary calls (`(name, ObjectRef)`, rank 0's first) as an install's is."""
        answers = self.call("score_canary", "scoring the weight canary", timeout_s, tokens)
        canary = gather(trainer, "scoring the weight canary", timeout_s, self.log_dir)[0]
        return self.canary.check(canary, answers, self.names)

    def install(self, bundle: WeightBundle, timeout_s: float, trainer_canary: list | None = None) -> dict[str, float]:
        """Install in every engine; the first engine's timings and each engine's served version (the canary is
        held: `start_install`)."""
        self.start_install(bundle, timeout_s, trainer_canary)
        return self.finish_install()

    def start_install(
        self, bundle: WeightBundle, timeout_s: float, trainer_canary: list | None = None
    ) -> dict[str, float]:
        """Send the install to every engine without waiting for it (finish_install waits, within timeout_s);
        generations sent meanwhile wait for it on their engine. Returns the figures of the install before, if
        it was not waited for yet (empty if none was pending). `trainer_canary`: the trainer ranks' calls that score
        the bundle's canary (`(name, ObjectRef)`, rank 0's first), held with the engines' answers when the install
        finishes, and checked against them by `settle_canary`."""
        previous = self.finish_install()
        # each engine loads it after the generations sent before it (in a list: Ray passes them unresolved, so the
        # bundle is fetched and verified meanwhile): every batch's weights follow from the order of the calls alone
        sent = [
            (engine.install.remote(bundle, earlier=self.sent_since_install.pop(i, [])), self.restarts.life(i))
            for i, engine in enumerate(self.engines)
        ]
        deadline = time.monotonic() + timeout_s
        self.pending, self.version = PendingInstall(bundle, sent, deadline, trainer_canary or []), bundle.version
        return previous

    def finish_install(self) -> dict[str, float]:
        """Wait for the pending install (if any); its figures, as the install method returns them. Its canary
        answers are held for `settle_canary` (a canary held from an install before is checked first)."""
        pending, self.pending = self.pending, None
        if pending is None:
            return {}
        bundle, what = pending.bundle, f"installing weights v{pending.bundle.version}"
        # a lost engine is sent the bundle again; one brought back meanwhile (bring_back) serves it already
        received = [
            self.restarts.wait(
                i,
                ref,
                life,
                lambda i=i: self.engines[i].install.remote(bundle, resent=True),
                what,
                pending.deadline,
                self.version,
                reinstall=False,
            )
            for i, (ref, life) in enumerate(pending.sent)
        ]
        versions = {r["version"] for r in received}
        if versions != {bundle.version}:
            raise RuntimeError(
                f"after installing v{bundle.version} the engines serve versions {[r['version'] for r in received]}"
            )
        self._hold_canary(pending, received)
        metrics = {f"sampler/engine_{i}/weight_version": float(r["version"]) for i, r in enumerate(received)}
        return {
            **received[0],
            "peak_rss_mb": max(r["peak_rss_mb"] for r in received),
            **metrics,
            "sampler/restarts": float(self.restarts.count),
            **self._idle_since_last_install(received),
        }

    def _hold_canary(self, pending: PendingInstall, received: list[dict]) -> None:
        """Take each engine's canary answer out of its figures and hold them with the trainer's calls."""
        answers = [r.pop("canary", None) for r in received]
        engine_s = max(r.pop("canary_s", 0.0) for r in received)
        self.settle_canary()  # one nobody settled is still checked: a canary is never skipped
        if pending.bundle.canary is not None and pending.trainer_canary:
            version, trainer = pending.bundle.version, pending.trainer_canary
            self.held = HeldCanary(version, answers, engine_s, trainer, pending.deadline)

    def settle_canary(self) -> dict[str, float]:
        """Check the held canary (the last finished install's) against the trainer's score of it, which ran beside
        the install and, in a run, beside what follows until the next batch is sent (`rl_tpu/sync/canary.py`).
        Its figures for the step's metrics (none held: empty); `time/canary_s` is the engines' scoring, on their
        way from the install to the next generation, `time/canary_trainer_s` the trainer's."""
        held, self.held = self.held, None
        if held is None:
            return {}
        what = f"scoring the weight canary of v{held.version}"
        canary = gather(held.trainer, what, max(0.0, held.deadline - time.monotonic()), self.log_dir)[0]
        figures = self.canary.check(canary, held.answers, self.names)
        return {**figures, "time/canary_s": held.engine_s, "time/canary_trainer_s": canary.seconds}

    def _idle_since_last_install(self, received: list[dict]) -> dict[str, float]:
        """`time/sampler_idle_s`: seconds since the previous install in which the engines (on average) neither
        generated nor installed. A restarted engine's count starts again; it is left out for that install."""
        now, busy = time.perf_counter(), [r["busy_s"] for r in received]
        last, self.last_install = self.last_install, (now, busy)
        if last is None or len(last[1]) != len(busy) or any(b < a for a, b in zip(last[1], busy)):
            return {}
        window, worked = now - last[0], statistics.fmean(b - a for a, b in zip(last[1], busy))
        return {"time/sampler_idle_s": max(0.0, window - worked)}
