"""Sweeps: `hydra/launcher=ray` runs a sweep's trials as Ray tasks as their placement fits (`ray_launcher`),
`hydra/sweeper=optuna` an Optuna study over the overrides (`optuna_study`). The Hydra plugins in
`hydra_plugins/` are thin shims over these. An entry point: may import any part.
"""
