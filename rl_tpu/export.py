"""`python -m rl_tpu.export CHECKPOINT_OR_RUN OUT`: a checkpoint as a Hugging Face folder (rl_tpu/outputs/export.py)."""

from rl_tpu.outputs.export import main

if __name__ == "__main__":
    main()
