"""The `episode` section: multi-turn episodes with tools (rl_tpu/episodes/). Key names follow verl's
`actor_rollout_ref.rollout.multi_turn` where verl has one (noted beside each)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

RENDERERS = ("auto", "chat", "plain")
EPISODE_REWARDS = ("plugin", "tools", "sum")
TRUNCATE_SIDES = ("left", "right", "middle")
SCHEDULINGS = ("async", "lockstep")


@dataclass
class EpisodeConfig:
    enable: bool = False  # rollouts are multi-turn episodes with tools (verl: multi_turn.enable)
    max_turns: int = 4  # model turns in an episode (verl: max_assistant_turns)
    # model and tool tokens after the prompt; None: sampler.response_length (the cap of each turn) x max_turns
    max_tokens: Optional[int] = None
    tools_config_file: Optional[str] = None  # verl's tools YAML of BaseTool subclasses (verl: tool_config_path)
    function_tool_path: Optional[str] = None  # a .py file of verl `@function_tool` functions (verl: the same key)
    tool_parser: str = "hermes"  # verl's tool-call parser by name (verl: format)
    # how tool results become tokens: chat (the model's chat template, through verl's Continuous Token builder),
    # plain (tool_response_format, for base models without a template), auto (chat when there is a template)
    renderer: str = "auto"
    tool_response_format: str = "\n<tool_response>\n{result}\n</tool_response>\n"  # the plain renderer's text
    stop: list[str] = field(default_factory=list)  # strings that end a model turn (kept), e.g. ["</tool_call>"]
    max_parallel_calls: int = 1  # calls of one turn that run (verl: the same key)
    max_tool_response_chars: int = 256  # a result longer than this is cut (verl: max_tool_response_length)
    tool_response_truncate_side: str = "middle"  # where a long result is cut: left, right, middle (verl's key)
    tool_timeout_s: float = 10.0  # per call; a call past it fails (counted) and its worker is replaced
    # stop the run when a larger fraction of one batch's tool calls fails (raised, timed out, crashed, returned
    # garbage, found its worker down), or its first calls all do: as reward.max_failure_rate; 1.0: never stop
    max_tool_failure_rate: float = 0.1
    tool_workers: int = 2  # tool worker processes per engine
    # calls a tool worker runs at once: they overlap while they await (a server, a sandbox, a search); code that
    # blocks (time.sleep, a synchronous client) runs one call at a time in each worker whatever this says
    tool_calls_per_worker: int = 32
    # async: an episode goes back to the engine as soon as its own calls returned (at once while the tools wait, in
    # the engine's next round while they compute); lockstep: every live episode goes to the engine together at each
    # turn and waits for the batch's slowest tool call. The same episodes either way; async took 0.52 of lockstep's
    # step with a heavy-tailed remote tool and 1.00 with a CPU-bound one (two cores, benchmarks/results/episodes.json)
    scheduling: str = "async"
    # async: tool calls of all episodes running at once, on all of an engine's tool workers together (an episode's
    # calls wait for room; one episode's calls always go); bounds what a remote environment sees at once
    max_calls_in_flight: int = 64
    tool_memory_mb: Optional[int] = 4096  # what each tool worker may allocate beyond its loaded code; null: no limit
    # an episode's reward: the reward plugin's (`reward.*`), the tools' (execute's step rewards plus calc_reward,
    # summed over the episode's calls), or their sum
    reward: str = "plugin"

    def __post_init__(self) -> None:
        for key, value, allowed in (
            ("renderer", self.renderer, RENDERERS),
            ("reward", self.reward, EPISODE_REWARDS),
            ("tool_response_truncate_side", self.tool_response_truncate_side, TRUNCATE_SIDES),
            ("scheduling", self.scheduling, SCHEDULINGS),
        ):
            if value not in allowed:
                raise ValueError(f"episode.{key}={value!r}: allowed values are {', '.join(allowed)}")
        for key in (
            "max_turns",
            "max_parallel_calls",
            "max_tool_response_chars",
            "tool_workers",
            "tool_calls_per_worker",
            "max_calls_in_flight",
        ):
            if getattr(self, key) < 1:
                raise ValueError(f"episode.{key}={getattr(self, key)} must be >= 1")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"episode.max_tokens={self.max_tokens} must be >= 1 (null: response_length x max_turns)")
        if self.tool_timeout_s <= 0:
            raise ValueError(f"episode.tool_timeout_s={self.tool_timeout_s} must be > 0")
        if not 0.0 <= self.max_tool_failure_rate <= 1.0:
            raise ValueError(f"episode.max_tool_failure_rate={self.max_tool_failure_rate} must be in [0, 1]")
        if "{result}" not in self.tool_response_format:
            raise ValueError(f"episode.tool_response_format={self.tool_response_format!r} must contain {{result}}")
        if self.enable and not (self.tools_config_file or self.function_tool_path):
            raise ValueError("episode.enable=true needs episode.tools_config_file or episode.function_tool_path")
