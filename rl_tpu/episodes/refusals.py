"""`BadArguments`: what a tool raises to refuse a call's arguments, the model's mistake rather than the tool's failure.

A module of its own: a tool worker runs as `__main__` (`python -m rl_tpu.episodes.tool_worker`), so a class defined
there would not be the one a tool imports. Imports nothing.
"""


class BadArguments(ValueError):
    """A tool refuses a call's arguments (its message is the line the model reads): the call counts as malformed,
    as an unknown tool or bad JSON does, not as the tool's failure; its episode stays scored."""
