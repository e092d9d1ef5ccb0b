"""rl_tpu: GRPO post-training on a disaggregated FSDP2 trainer / vLLM sampler, on CPU, GPU and TPU."""

import os
import re
from pathlib import Path

__version__ = "0.1.0"


def host_has_tpu_devices(dev: Path = Path("/dev")) -> bool:
    """TPU VMs expose their chips as /dev/accel* (v2-v5p) or VFIO groups /dev/vfio/<n> (v5e, v6e)."""
    vfio = dev / "vfio"
    return any(dev.glob("accel*")) or (vfio.is_dir() and any(re.fullmatch(r"\d+", p.name) for p in vfio.iterdir()))


# With torch-tpu installed, libtpu loads with torch and asks the cloud metadata server for the TPU topology; on a
# host without a TPU (a CPU head node of a TPU cluster) it retries for minutes and every CPU backward() waits
# (torch-tpu 0.2.0, libtpu 0.0.52). Set before any module imports torch; a value the user set wins.
if not host_has_tpu_devices():
    os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")
