"""Data: verl-schema datasets (parquet, JSONL), prompts and their chat templates, row-level errors, the synthetic
arithmetic task and reasoning-gym's tasks. May import `rl_tpu.config` only, and the built-in `rewards` (which
import nothing of rl_tpu): reasoning-gym's rows are made by the function that scores them.
"""
