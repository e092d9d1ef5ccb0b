"""Algorithms: verl's advantage estimators and policy losses by verl's names and keys (`core`), rl_tpu's own
estimator for episodes, a baseline per model turn (`turn_baseline`: `grpo_turn`), the losses'
facts and plug-ins by import path (`registry`), the KL in the reward with verl's KL controllers (`kl_reward`), and
the one owner of the way from a step's grades to its `TrainBatch` (`learning_signal`), with which rows count by
each rollout's outcome (`outcomes`). May import config and records only.

To add one: a loss or estimator is a function with verl's signature, named by import path
(`actor.policy_loss.loss_mode=my_pkg.losses:my_loss`, `algorithm.adv_estimator=...`) and stating its facts
(`registry.LossFacts`, `registry.EstimatorFacts`); no file here changes (docs/extending.md). A step between the
grades and the advantages (a reward shaping, a filter) is a function in `learning_signal` that
`LearningSignal.score`, `select` or `train_batch` calls, with its config key checked in `learning_signal.validate`.
"""
