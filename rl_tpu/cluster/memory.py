"""What a process reports about its own memory, for the metrics of the actor it runs."""

from __future__ import annotations

import resource


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
