"""Algorithms: verl's advantage estimators and policy losses by verl's names and keys (`core`), the losses'
facts and plug-ins by import path (`registry`), and the KL in the reward with verl's KL controllers (`kl_reward`).
May import config only.

To add one: a loss or estimator is a function with verl's signature, named by import path
(`actor.policy_loss.loss_mode=my_pkg.losses:my_loss`, `algorithm.adv_estimator=...`) and stating its facts
(`registry.LossFacts`, `registry.EstimatorFacts`); no file here changes (docs/extending.md).
"""
