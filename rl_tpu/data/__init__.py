"""Data: verl-schema datasets (parquet, JSONL), prompts and their chat templates, row-level errors, and the
synthetic arithmetic task. May import `rl_tpu.config` only.
"""
