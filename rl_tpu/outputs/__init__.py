"""Outputs of a run: `metrics.jsonl` and the progress bar (`metrics`), trackers through verl's `Tracking`
(`tracking`), plots (`plots`), run and sweep reports (`report`), the rollout record's files (`rollout_log`) and its
page (`inspect/`), checkpoint folders (`checkpoints`), the Hugging Face export with its model card (`export`) and
the recipes' seed studies (`seed_runs`).

Used by the controller and the entry points only: a trainer rank never imports the reporting stack. May
import models, data, config and records.
"""
