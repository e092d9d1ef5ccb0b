"""The controller: the driver process that owns the run and the only part that knows every other.

    prompts (data)                                     Ray actors
        |                 generate(prompts, version)  +------------------------+
        v            +------------------------------> | sampler: vLLM engines  |
    +-----------+    |   <-- Rollout records --------  | (sampler/engine, pool) |
    |  run.py   |----+                                +-----------^------------+
    |  loop     |    score(rollouts) +---------------+             | install(WeightBundle v)
    |  step.py  |------------------> | grader procs  |             |  versioned, checksummed
    |           | <-- Grades ------- +---------------+             |  buckets (sync/)
    |           |    train(TrainBatch)  +-------------------------+ |
    |           |---------------------> | trainer: FSDP2 ranks    |-+ publish(v)
    |           | <-- metrics --------- | (trainer/worker)        |
    +-----------+                       +-------------------------+
         | metrics.jsonl, trackers, plots, checkpoints, export (outputs/)

Backpressure: `rollouts.RolloutQueue` keeps at most `trainer.max_staleness` generation batches queued
ahead of the trainer (0: synchronous, each batch sampled with the previous step's weights), and every
rollout's weight version is checked against that window.

Owns: the run and its attempts (`run`), one step (`step`: collect, score, train, publish, install, each timed by
`phases`), the batches queued ahead and graded (`rollouts`), the held-out evaluation (`evaluation`), starting and
calling the actors (`actors`), restarts and stops (`recovery`), the checks across config sections (`checks`). What
the grades become before the update (rewards, shaping, advantages) is rl_tpu/algorithms/learning_signal.py's.
May import every other part; nothing in rl_tpu but the entry points and sweeps imports it.
"""
