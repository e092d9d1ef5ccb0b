"""What an engine needs to run episodes (`EpisodeOptions`, from the `episode` config section) and how it builds
them (`build_runner`: the parser, the tool workers, the renderer and the scheduler of one engine)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_tpu.config import OutcomesConfig
from rl_tpu.episodes.asynchronous import AsyncScheduler
from rl_tpu.episodes.episode import EpisodeLimits
from rl_tpu.episodes.loop import EpisodeRunner, LockstepScheduler, ToolCallParser
from rl_tpu.episodes.render import make_renderer
from rl_tpu.episodes.tools import ToolBox, ToolSettings


@dataclass(frozen=True)
class EpisodeOptions:
    """What an engine needs to run episodes (from the `episode` config section)."""

    limits: EpisodeLimits
    tools: ToolSettings
    tool_parser: str
    renderer: str  # auto | chat | plain
    tool_response_format: str  # plain renderer
    stop: tuple[str, ...]  # strings that end a model turn (kept in its ids)
    outcomes: OutcomesConfig | None = None  # which episodes are played again (`algorithm.outcomes`)
    scheduling: str = "async"  # async | lockstep (`episode.scheduling`)
    max_calls_in_flight: int = 64  # async: tool calls of all episodes running at once


def build_runner(
    options: EpisodeOptions, tokenizer: Any, model_type: str | None, engine_on_cpu: bool = True
) -> EpisodeRunner:
    """The parser, the tool workers, the renderer and the scheduler of one engine (`engine_on_cpu`: its steps
    compute on the host's cores, beside the tools)."""
    parser = ToolCallParser(options.tool_parser, tokenizer)
    tools = ToolBox(options.tools)
    try:
        renderer = make_renderer(
            options.renderer, tokenizer, options.tool_response_format, model_type, list(tools.schemas.values())
        )
    except Exception:
        tools.close()
        raise
    if options.scheduling == "async":
        scheduler = AsyncScheduler(options.max_calls_in_flight, engine_on_cpu)
    else:
        scheduler = LockstepScheduler()
    return EpisodeRunner(options.limits, parser, tools, renderer, options.outcomes, scheduler)
