"""The sampler: vLLM engines as Ray actors that make rollouts and take in weight bundles (`engine`), whose calls
take turns (`turns`), fixed sequences scored under what an engine serves (`scoring`: the weight canary, the
consistency certificate), several engines serving as one (`pool`), a lost one restarted in place (`restarts`), and
an engine's memory estimate of itself for the memory plan (`memory`).

Never imports the trainer, the grader, the outputs or the controller; may import episodes, cluster, models, sync,
data, config and records.
"""
