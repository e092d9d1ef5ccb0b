"""Episodes: multi-turn rollouts in which the model calls tools and reads their results.

    prompt ids --> engine turn (model ids, logprobs, version) --> tool-call parser (verl's, by name)
        ^                                                               |  calls
        |   environment ids (mask 0), rendered by the chat template     v
        +---------------------------------------------- tool workers (verl BaseTool / @function_tool)

The turn loop (`loop`: what a turn does to an episode, `episode`: its record) is engine-agnostic: the sampler hands
it a `TurnEngine` (turns queued one by one, each engine step returning those it finished), driven by a scheduler:
lockstep (`loop`) or episodes that advance on their own (`asynchronous`); `build` puts an engine's parts together. Tools run in worker processes with deadlines and limits (`tools`, `tool_worker`), as reward
plugins do; a tool that hangs, raises or returns garbage fails that call, counted, never the run. The
environment's tokens are appended as ids (`render`), never by decoding and re-encoding the model's turn.

Never imports a role (trainer, sampler, grader), the outputs or the controller; may import cluster, models, data,
config and records.
"""
