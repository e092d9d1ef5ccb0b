"""Algorithms: verl's advantage estimators and policy losses by verl's names and keys (`core`), the KL
in the reward with verl's KL controllers (`kl_reward`), and the one owner of the way from a step's grades to its
`TrainBatch` (`learning_signal`). May import config and records only.
To add one: a step between the grades and the advantages (a reward shaping, a filter) is a function in
`learning_signal` that `LearningSignal.score`, `select` or `train_batch` calls, with its config key checked in
`learning_signal.validate`.
"""
