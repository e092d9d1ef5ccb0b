"""The trainer: FSDP2 ranks as Ray actors (`worker.TrainerWorker`), the policy update (`update`), the
TorchTitan-style parallelisation (`parallelize`), weights leaving as bundles or Hugging Face folders
(`weights`), checkpoints (`checkpoint`), its side of the weight canary (`canary`) and its memory estimate of itself
for the memory plan (`memory`).

Never imports the sampler, the grader, the outputs or the controller; may import algorithms, cluster,
models, sync, data, config and records.
"""
