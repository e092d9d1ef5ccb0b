"""Episodes' model turns on the engine's vLLM through its request-level API (`EngineRequests`, a `TurnEngine`): a
turn is queued as it becomes ready and each engine step batches every turn under way, so episodes advance on their
own (`rl_tpu.episodes.asynchronous`); lockstep queues a turn of every live episode and steps until all ended.

Requests go in through `LLM.enqueue`, the path `LLM.generate` takes (`_add_completion_requests`: the same prompt
rendering, `SamplingParams` with their per-request seed, and LoRA request), and come out of `llm_engine.step()`, the
loop `generate` runs (`_run_engine`): the same tokens and logprobs as one `generate` call per turn.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from rl_tpu.episodes.episode import TurnOutput, TurnRequest


class EngineRequests:
    """`params(request)`: the turn's `SamplingParams`; `tokens(completion)`: its ids and logprobs; `lora_request`:
    the served adapter (None: full weights); `version`: the weights serving the whole batch (installs wait for it)."""

    def __init__(
        self,
        llm: Any,
        params: Callable[[TurnRequest], Any],
        tokens: Callable[[Any], tuple[list[int], list[float]]],
        lora_request: Any,
        version: int,
    ):
        self.llm, self.params, self.tokens, self.lora_request, self.version = llm, params, tokens, lora_request, version
        self.pending: set[str] = set()
        self.busy_s = 0.0  # seconds spent in engine steps

    def add(self, request: TurnRequest) -> str:
        from vllm.inputs import TokensPrompt

        [internal] = self.llm.enqueue(
            TokensPrompt(prompt_token_ids=request.ids),
            self.params(request),
            lora_request=self.lora_request,
            use_tqdm=False,
        )
        # enqueue returns vLLM's internal id (the external one with a random suffix); outputs carry the external one
        request_id = self.llm.llm_engine.output_processor.request_states[internal].external_req_id
        self.pending.add(request_id)
        return request_id

    def step(self) -> list[tuple[str, TurnOutput]]:
        start = time.perf_counter()
        outputs = self.llm.llm_engine.step()
        self.busy_s += time.perf_counter() - start
        ended = []
        for output in outputs:
            if output.finished:
                self.pending.discard(output.request_id)
                completion = output.outputs[0]
                ids, logprobs = self.tokens(completion)
                ended.append(
                    (output.request_id, TurnOutput(ids, logprobs, completion.finish_reason or "length", self.version))
                )
        return ended

    def busy(self) -> bool:
        return self.llm.llm_engine.has_unfinished_requests()

    def abort(self) -> None:
        """Drops the turns under way (a batch that failed): the engine's next call starts clean."""
        if self.pending:
            self.llm.llm_engine.abort_request(sorted(self.pending), internal=False)
            self.pending.clear()
