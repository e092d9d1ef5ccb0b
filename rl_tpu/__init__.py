"""rl_tpu: GRPO post-training on a disaggregated FSDP2 trainer / vLLM sampler, on CPU, GPU and TPU."""

__version__ = "0.1.0"
