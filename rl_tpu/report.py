"""`python -m rl_tpu.report RUN_OR_SWEEP_DIR`: a run's summary and plots, or a sweep's table (rl_tpu/outputs/report.py)."""

from rl_tpu.outputs.report import main

if __name__ == "__main__":
    main()
