"""`algorithm.adv_estimator=grpo_turn`: GRPO with a baseline per model turn, for episodes of several turns.

GRPO gives every token of an episode the same advantage, its outcome against the mean of its group. In episodes
that end when they succeed (a game won, a task solved), the later turns exist mostly in the episodes that had not
succeeded yet: their tokens are compared with a group mean raised by the episodes that succeeded early, so they
are pushed down on average whatever they did: the tokens a turn always has (a call's format) get small gradients
that point the same way step after step (Adam makes full-size steps of them: a likely cause of the broken formats
in recipes/guess_number's log), and the signal of what a later turn chose is mixed with that bias.

Here a turn that the environment answered (a tool call), the `k`-th of its episode, is compared only with the
turns `k` of its group that the environment answered too: the advantage of its tokens is `(score - mean) / (std +
eps)` over those episodes' scores (`std` unbiased, as verl's GRPO; not divided with
`algorithm.norm_adv_by_std_in_grpo=false`), 0 where it is the only one of its group (nothing to compare it with).
An episode's last turn, when nothing answered it (its answer, or a stop after the game was won), gets GRPO's
advantage against the whole group, so stopping is still judged against going on. A model turn is a run of model
tokens between environment tokens (`model_masks`). Without episodes every completion is one last turn: this is GRPO.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

EPS = 1e-6  # verl's GRPO epsilon


def turn_spans(mask: list[int]) -> list[tuple[int, int]]:
    """The model turns of a row: each maximal run of 1s in `mask`, as (start, end)."""
    spans, start = [], None
    for j, value in enumerate([*mask, 0]):
        if value and start is None:
            start = j
        elif not value and start is not None:
            spans.append((start, j))
            start = None
    return spans


def grpo_turn_advantages(
    scores: list[float], groups: list[int], model_masks: list[list[int]], norm_by_std: bool
) -> list[list[float]]:
    """Each token's advantage (0 on environment tokens): see the module's docstring."""
    whole: dict[int, list[float]] = defaultdict(list)  # group -> its scores
    answered: dict[tuple[int, int], list[float]] = defaultdict(list)  # (group, turn) -> scores of those answered
    spans = [turn_spans(mask) for mask in model_masks]
    for score, group, turns, mask in zip(scores, groups, spans, model_masks, strict=True):
        whole[group].append(score)
        for k in range(_answered_turns(turns, mask)):
            answered[group, k].append(score)
    rows = []
    for score, group, turns, mask in zip(scores, groups, spans, model_masks, strict=True):
        row = [0.0] * len(mask)
        calls = _answered_turns(turns, mask)
        for k, (start, end) in enumerate(turns):
            peers = answered[group, k] if k < calls else whole[group]
            row[start:end] = [_normalised(score, peers, norm_by_std)] * (end - start)
        rows.append(row)
    return rows


def _answered_turns(turns: list[tuple[int, int]], mask: list[int]) -> int:
    """How many of the row's turns the environment answered: all but a last one that ends the row."""
    return len(turns) - 1 if turns and turns[-1][1] == len(mask) else len(turns)


def _normalised(score: float, peers: list[float], norm_by_std: bool) -> float:
    if len(peers) < 2:
        return 0.0
    value = score - statistics.fmean(peers)
    return value / (statistics.stdev(peers) + EPS) if norm_by_std else value
