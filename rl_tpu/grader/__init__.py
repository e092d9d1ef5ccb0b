"""The grader: reward functions and verl-signature plugins run in worker processes with per-sample
timeouts, memory and CPU limits and failure accounting (`grader`, the driver side; `processes`, the
worker side, started as `python -m rl_tpu.grader.processes`).

Never imports the trainer, the sampler, the outputs or the controller; may import cluster (its worker pool), config
and records.
"""
