"""The preflight: `rl-tpu doctor +recipe=NAME [overrides]` (or `python -m rl_tpu.doctor ...`, or a run's
`trainer.preflight=true`) runs two short steps of a run's own settings and checks what makes a run learn nothing.

Owns: the checks (`checks`: small functions of plain records, each returning a `Check` that names a failure's cause
and the config keys that change it), the short run that feeds them (`probe`: the run's own `run()` with a
`RunWatch`, rl_tpu/controller/watch.py) and the command (`command`). Imports the controller and what it returns;
nothing in rl_tpu but the entry point (rl_tpu/main.py) imports it.

To add a check: a function in `checks` of what a run shows (the watch's inputs, its steps' metrics or batches),
one line in `DoctorWatch.report`, a unit test that injects its cause (tests/unit/test_doctor.py), its row in
docs/preflight.md.
"""
