"""`python -m rl_tpu.doctor +recipe=NAME [overrides]`: the same as `rl-tpu doctor ...`."""

import sys

from rl_tpu.doctor.command import cli

if __name__ == "__main__":
    cli(sys.argv[1:])
