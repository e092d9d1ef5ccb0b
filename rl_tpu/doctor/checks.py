"""The preflight's checks: each a small function of plain records (a short run's step metrics, its groups' scores,
the tokenizer, the prompts' ids, config values) that returns one `Check`. A failed check names its cause and the
config keys that change it; a check without what it reads is "not available", never passed.

The reward plugin's check (`reward_plugin`) reads the grader's failures for a few real rows; the tool-call check
(`tool_calls`) runs verl's parser as the episodes do (rl_tpu/episodes/loop.py).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any

from rl_tpu.episodes.loop import ToolCallParser
from rl_tpu.grader.grader import Failure
from rl_tpu.models.agreement import BOUNDS
from rl_tpu.sync.canary import BOUNDS as CANARY_BOUNDS
from rl_tpu.sync.canary import bound as canary_bound

PASSED, FAILED, NOT_AVAILABLE = "passed", "FAILED", "not available"
CANARY = "sync/canary_gap"  # the engine's canary logprobs after an install, against the trainer's (its largest gap)
# tokens of chat formats: a tokenizer that has one but no chat template feeds a chat model raw text
CHAT_TOKENS = ("<|im_start|>", "<|start_header_id|>", "<start_of_turn>", "<|user|>", "[INST]")
PROBE = "PREFLIGHT_PROBE"  # a user message's text, found again in what a chat template renders around it
EXAMPLE_ARGUMENT = {"string": "1", "number": 1, "integer": 1, "boolean": True}
VARIANCE_KEYS = (
    "sampler.n, sampler.temperature, the task's difficulty for the model (data.*), reward.name or reward.custom"
)


@dataclass(frozen=True)
class Check:
    name: str
    status: str  # PASSED, FAILED or NOT_AVAILABLE
    detail: str  # what was seen; for a failure, its cause
    keys: str = ""  # a failure's config keys: what changes it

    def line(self) -> str:
        change = f" [change: {self.keys}]" if self.status == FAILED and self.keys else ""
        return f"{self.name:<17} {self.status}: {self.detail}{change}"


def unavailable(name: str, why: str) -> Check:
    return Check(name, NOT_AVAILABLE, why)


def _values(metrics: list[dict[str, Any]], key: str) -> list[float]:
    return [float(m[key]) for m in metrics if key in m]


def generation_prompt(tokenizer: Any) -> str:
    """What the chat template writes after a conversation for the model's turn to begin; where it writes nothing
    more there, what it writes after a user message's text."""
    turn = [{"role": "user", "content": PROBE}]
    closed = tokenizer.apply_chat_template(turn, tokenize=False)
    opened = tokenizer.apply_chat_template(turn, tokenize=False, add_generation_prompt=True)
    if opened.startswith(closed) and opened[len(closed) :].strip():
        return opened[len(closed) :]
    return opened.rpartition(PROBE)[2]


def chat_template(tokenizer: Any, prompts: list[list[int]]) -> Check:
    """1. Where the model has a chat template, every prompt is rendered through it (it ends with the template's
    generation prompt); a tokenizer with chat tokens but no template is a chat model fed raw text."""
    name = "chat template"
    if not getattr(tokenizer, "chat_template", None):
        found = [token for token in CHAT_TOKENS if token in tokenizer.get_vocab()]
        if found:
            return Check(
                name,
                FAILED,
                f"the tokenizer has chat tokens ({', '.join(found)}) but no chat template: prompts are the rows' raw "
                "text, not the chat format the model was tuned on",
                "model.path (a tokenizer whose tokenizer_config.json or chat_template.jinja holds the template)",
            )
        return Check(name, PASSED, "the model has no chat template (nor chat tokens): prompts are the rows' text")
    marker = generation_prompt(tokenizer).strip()
    bare = [i for i, ids in enumerate(prompts) if not tokenizer.decode(ids).rstrip().endswith(marker)]
    if bare:
        return Check(
            name,
            FAILED,
            f"{len(bare)} of {len(prompts)} prompts (the first: prompt {bare[0]}) do not end with the chat template's "
            f"generation prompt {marker!r}: the model reads them as raw text, not in its chat format",
            "data.prompt_key (a column of chat messages, which rl_tpu/data/datasets.py renders through the template), "
            "model.path (its tokenizer's template)",
        )
    return Check(name, PASSED, f"{len(prompts)} prompts end with the template's generation prompt {marker!r}")


def eos_reachable(metrics: list[dict[str, Any]], limit: int, keys: str) -> Check:
    """2. Some completions end before the length limit: the model can reach its end-of-sequence token."""
    name = "EOS reachable"
    cut = _values(metrics, "response/truncated_frac")
    if not cut:
        return unavailable(name, "no step finished")
    if min(cut) >= 1.0:
        return Check(
            name,
            FAILED,
            f"every completion of {len(cut)} step(s) ran to the {limit}-token limit without an end-of-sequence "
            "token: no answer ends, so every reward reads a cut answer",
            f"{keys} (raise it); if the model never ends at all, its eos_token_id (generation_config.json)",
        )
    return Check(name, PASSED, f"{1 - statistics.fmean(cut):.0%} of the completions ended before {limit} tokens")


def reward_variance(groups: list[list[float]]) -> Check:
    """3. Some groups' rewards vary: GRPO's advantages are each reward less its group's mean, zero where all agree."""
    name = "reward variance"
    if not groups:
        return unavailable(name, "no step finished")
    varied = sum(len(g) > 1 and max(g) > min(g) for g in groups)
    if not varied:
        seen = sorted({score for g in groups for score in g})
        shown = ", ".join(f"{s:g}" for s in seen[:5]) + (", ..." if len(seen) > 5 else "")
        return Check(
            name,
            FAILED,
            f"in all {len(groups)} groups every completion scored the same (scores seen: {shown}; "
            f"{len(groups[0])} completion(s) a group): every advantage is zero, and nothing is learned",
            VARIANCE_KEYS,
        )
    return Check(name, PASSED, f"{varied} of {len(groups)} groups' rewards varied")


def gradient(metrics: list[dict[str, Any]], rewards_varied: bool) -> Check:
    """4. Some update had a gradient: its norm (before clipping) above zero and finite."""
    name = "gradient"
    norms = _values(metrics, "actor/grad_norm")
    finite = [n for n in norms if math.isfinite(n)]
    if not norms:
        return unavailable(name, "no step finished")
    if not finite:
        return Check(
            name,
            FAILED,
            f"the gradient norm was not finite in any of {len(norms)} step(s): every update was skipped",
            "algorithm.lr, algorithm.grad_clip, model.dtype=float32",
        )
    if max(finite) > 0:
        return Check(name, PASSED, f"largest gradient norm {max(finite):.3g}")
    if not rewards_varied:
        return Check(
            name,
            FAILED,
            "the gradient norm was 0 in every step: no group's rewards varied (reward variance), so every "
            "advantage was zero",
            VARIANCE_KEYS,
        )
    return Check(
        name,
        FAILED,
        "the gradient norm was 0 in every step though some groups' rewards varied: the loss gives no gradient",
        "actor.policy_loss.loss_mode, algorithm.adv_estimator, algorithm.overlong_filter (with every completion "
        "cut), actor.lora.* (the weights trained)",
    )


def logprob_bound(dtype: str) -> float | None:
    """The largest logprob difference the consistency certificate trusts for `dtype` (rl_tpu/models/agreement.py)."""
    return BOUNDS.get(dtype, {}).get("max_abs_logprob_diff")


def canary(metrics: list[dict[str, Any]], dtype: str, max_gap: float | None = None) -> Check:
    """5. After each sync, the engine scores the canary as the trainer does with the weights it published, within
    the canary's own bound (`sync.canary.max_gap`, or its dtype's: rl_tpu/sync/canary.py)."""
    name = "canary"
    gaps = _values(metrics, CANARY)
    if not gaps:
        return unavailable(name, f"no step reported {CANARY} (sync.canary.enable=false)")
    if max_gap is None and dtype not in CANARY_BOUNDS:
        return unavailable(name, f"no bound is set for model.dtype={dtype}")
    bound = canary_bound(dtype, max_gap)[0]
    worst = max(gaps, key=lambda g: g if math.isfinite(g) else math.inf)
    if not worst <= bound:
        return Check(
            name,
            FAILED,
            f"after a sync the engine's canary logprobs differ from the trainer's by {worst:.3g}, past the {dtype} "
            f"bound {bound:g}: the engine does not serve the weights the trainer published",
            "sync.transport, actor.lora.sync (an adapter's), model.dtype",
        )
    return Check(name, PASSED, f"largest canary gap {worst:.3g} after {len(gaps)} sync(s) (bound {bound:g})")


def logprob_gap(metrics: list[dict[str, Any]], dtype: str, old_logprob_source: str) -> Check:
    """7. The sampled tokens' logprobs, engine against trainer, within the consistency certificate's bound for the
    dtype; read only on steps that trained tokens of rollouts from the trainer's current weights (no staleness)."""
    name = "logprob gap"
    if old_logprob_source == "sampler":
        return unavailable(name, "actor.old_logprob_source=sampler: the trainer does not score the sampled tokens")
    # a step that trained no token (every row skipped: zero advantages) measured no gap
    fresh = [m for m in metrics if m.get("rollout/staleness", 0.0) == 0.0 and m.get("perf/train_tokens", 1.0) > 0]
    gaps, bound = _values(fresh, "actor/logprob_diff_max"), logprob_bound(dtype)
    if not gaps:
        return unavailable(name, "no step trained a token of rollouts from the trainer's own weights")
    if bound is None:
        return unavailable(name, f"no bound is set for model.dtype={dtype}")
    worst, mean = max(gaps), max(_values(fresh, "actor/logprob_diff"), default=math.nan)
    if not worst <= bound:
        return Check(
            name,
            FAILED,
            f"the engine's logprobs of the sampled tokens differ from the trainer's by up to {worst:.3g} (mean "
            f"{mean:.3g} a token), past the {dtype} bound {bound:g}: the run trains on another policy's logprobs",
            "model.dtype=float32, model.fp32_residual=true; if float32 fails too, the engine does not compute the "
            "trainer's model: python -m rl_tpu.consistency (docs/reliability.md)",
        )
    return Check(name, PASSED, f"largest gap {worst:.3g}, mean {mean:.3g} a token (bound {bound:g}, {dtype})")


def template_call(tokenizer: Any, tool: dict) -> str:
    """An assistant turn holding one call of `tool` as the chat template writes it (the format the model is shown)."""
    function = tool["function"]
    properties = (function.get("parameters") or {}).get("properties") or {}
    arguments = {}
    for key, spec in properties.items():
        kind = spec.get("type")
        arguments[key] = EXAMPLE_ARGUMENT.get(kind[0] if isinstance(kind, list) else kind, "1")
    user = {"role": "user", "content": PROBE}
    call = {"type": "function", "function": {"name": function["name"], "arguments": arguments}}
    asked = tokenizer.apply_chat_template([user], tools=[tool], tokenize=False, add_generation_prompt=True)
    whole = tokenizer.apply_chat_template(
        [user, {"role": "assistant", "content": "", "tool_calls": [call]}], tools=[tool], tokenize=False
    )
    return whole[len(asked) :] if whole.startswith(asked) else whole.rpartition(PROBE)[2]


def tool_calls(
    parser: str | None, tokenizer: Any, tools: list[dict] | None, prompt: list[int], metrics: list[dict[str, Any]]
) -> Check:
    """6. `episode.tool_parser` reads a call written the way the model is prompted to write one. With a chat template:
    the prompt names the tools and the parser reads a call as the template writes it. Without one, the format is
    learnt, not shown: the short run's episodes tell (calls read, or call blocks the parser could not read)."""
    name = "tool calls"
    if parser is None or not tools:
        return unavailable(name, "no episodes (episode.enable=false): completions call no tools")
    read = max(_values(metrics, "episode/tool_calls_mean"), default=0.0)
    unread = max(_values(metrics, "episode/malformed_calls_mean"), default=0.0)
    reader = ToolCallParser(parser, tokenizer)
    if not getattr(tokenizer, "chat_template", None):
        if read > 0:
            return Check(
                name, PASSED, f"episode.tool_parser={parser} read {read:.2g} calls an episode in the short run"
            )
        if unread > 0:
            return Check(
                name,
                FAILED,
                f"the model wrote call blocks ({reader.start_marker!r}) that episode.tool_parser={parser} could not "
                "read, and no call was read: every call the model makes is lost",
                "episode.tool_parser (the parser of the format the model was taught)",
            )
        return unavailable(name, "no chat template shows the call format, and no episode of the short run wrote a call")
    text = tokenizer.decode(prompt)
    unnamed = [t["function"]["name"] for t in tools if t["function"]["name"] not in text]
    if unnamed:
        return Check(
            name,
            FAILED,
            f"the prompt never names the tool(s) {', '.join(unnamed)}: the model is not told what it can call",
            "model.path (its chat template must render `tools`)",
        )
    tool = tools[0]["function"]["name"]
    written = template_call(tokenizer, tools[0])
    calls, _ = reader.parse(tokenizer.encode(written, add_special_tokens=False))
    if tool not in [called for called, _ in calls]:
        return Check(
            name,
            FAILED,
            f"episode.tool_parser={parser} reads no call from the way the chat template writes one "
            f"({written.strip()!r:.160}): every call the model makes would be lost",
            "episode.tool_parser (the parser of the model's chat format: hermes for Qwen2.5's, ...)",
        )
    return Check(name, PASSED, f"episode.tool_parser={parser} reads a {tool} call as the chat template writes it")


def reward_plugin(labels: list[str], scores: list[float], failures: list[Failure], keys: str) -> Check:
    """8. The reward gives a number for each of a few real rows' samples (`labels` say which), scored before any
    engine starts: a function that returns None, a string or raises fails here, named with the row."""
    name = "reward plugin"
    if not labels:
        return unavailable(name, "no rows were scored")
    if failures:
        rows_by_cause: dict[str, list[str]] = {}
        for failure in failures:
            rows_by_cause.setdefault(_last_line(failure.message) or failure.kind, []).append(labels[failure.index])
        causes = [f"{cause} ({_listed(rows)})" for cause, rows in rows_by_cause.items()]
        return Check(
            name,
            FAILED,
            f"reward {failures[0].reward} gave no number for {len(failures)} of {len(labels)} samples of the data's "
            f"rows: {'; '.join(causes)}",
            keys,
        )
    shown = ", ".join(f"{s:g}" for s in scores[:8])
    return Check(name, PASSED, f"numbers for all {len(labels)} samples ({shown})")


def _listed(items: list[str], most: int = 3) -> str:
    return ", ".join(items[:most]) + (f" and {len(items) - most} more" if len(items) > most else "")


def _last_line(message: str) -> str:
    lines = message.strip().splitlines()
    return lines[-1] if lines else ""
