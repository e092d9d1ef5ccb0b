"""Models: which model a run trains (`resolve`: `model.path`, or the locally built tiny preset and its warm
start), the warm-started presets shipped with the package and their checksums (`shipped`), the tiny Qwen3 model
and tokenizer (`tiny`), token logprobs in chunks and the batch layout (`logprobs`), precision settings
(`precision`), Hugging Face names and folders (`hf`), the model families' records (`families`) and the sizes the
memory plan reads (`shape`).

To add one (a model family): one `ModelFamily` record in `families.py` (docs/extending.md#a-model-family).

May import data, config and records.
"""
