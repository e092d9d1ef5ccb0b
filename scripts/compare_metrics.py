"""Two runs' metrics.jsonl compared on every key but timings, timestamps, throughput and memory figures.

    python scripts/compare_metrics.py BEFORE/metrics.jsonl AFTER/metrics.jsonl

A change of shape (a refactor) must leave a sync fp32 run's metrics identical: exit status 1 names each difference.
"""

from __future__ import annotations

import json
import sys


def varying(key: str) -> bool:
    """Figures that differ between two runs of the same code: wall-clock times, rates, peak memory."""
    seconds = key.endswith(("_s", "_per_s")) or key.endswith(("_s_mean", "_s_max"))  # episode/tool_wait_s_mean
    return key.startswith("time/") or key == "timestamp" or seconds or key.endswith("peak_rss_mb")


def differences(before: list[dict], after: list[dict]) -> tuple[list, int]:
    if len(before) != len(after):
        return [("lines", len(before), len(after))], 0
    found, compared = [], 0
    for line, (x, y) in enumerate(zip(before, after)):
        keys_x, keys_y = {k for k in x if not varying(k)}, {k for k in y if not varying(k)}
        if keys_x != keys_y:
            found.append((line, "keys", sorted(keys_x ^ keys_y)))
        for key in sorted(keys_x & keys_y):
            compared += 1
            if x[key] != y[key]:
                found.append((line, key, x[key], y[key]))
    return found, compared


def main() -> None:
    before, after = ([json.loads(line) for line in open(path)] for path in sys.argv[1:3])
    found, compared = differences(before, after)
    print(f"{len(before)} lines, {compared} values compared, {len(found)} differences")
    for difference in found[:20]:
        print("  ", difference)
    sys.exit(1 if found else 0)


if __name__ == "__main__":
    main()
