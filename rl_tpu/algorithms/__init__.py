"""Algorithms: verl's advantage estimators and policy losses by verl's names and keys (`core`), and the KL
in the reward with verl's KL controllers (`kl_reward`). May import config only.
"""
