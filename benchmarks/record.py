"""The results file every benchmark writes: when, on what machine, the load average around the run, the figures."""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path


def cpu_facts() -> dict:
    """The CPU by name, and whether it has AVX-512 (Linux; empty elsewhere)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return {}
    fields = dict(line.split(":", 1) for line in text.split("\n\n")[0].splitlines() if ":" in line)
    fields = {k.strip(): v.strip() for k, v in fields.items()}
    flags = set(fields.get("flags", "").split())
    return {
        "cpu": f"{fields.get('model name')} (family {fields.get('cpu family')}, model {fields.get('model')})",
        "avx512": "avx512f" in flags,
    }


def write_record(out: str | Path, load_before: tuple[float, float, float], **figures) -> dict:
    """Write `figures` with the date, the machine and the load average before and now to `out`, and say so."""
    record = {
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        **cpu_facts(),
        "load_average_before": load_before,
        "load_average_after": os.getloadavg(),
        **figures,
    }
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=2) + "\n")
    print(f"load average {load_before[0]:.2f} -> {record['load_average_after'][0]:.2f}; wrote {out}")
    return record
