"""What the test suite costs the machine: its wall time and the CPU seconds of its whole process tree (pytest, its
xdist workers, every CLI run, Ray's processes and actors, engines, ranks, tool workers, the browser), and from them
the floor no scheduling can beat on this host: CPU seconds / cores.

The tree's CPU is the kernel's count for a control group made for the command (Linux cgroup `cpuacct`, v1, or v2's
`cpu.stat`; it needs root): every process the command starts is in it, however it was started or reaped. Reaped
children's accounting would miss Ray's actors, whose raylet ignores SIGCHLD (so their CPU seconds are counted
nowhere), and polling /proc misses short-lived processes. Processes still in the group after the command ended
(leaked by a test) are named, and waited for up to a minute.

    python benchmarks/suite_cost.py                        # the README's test command: both tiers
    python benchmarks/suite_cost.py --tier unit            # -m "not e2e"
    python benchmarks/suite_cost.py --out results/suite_cost.json -- tests/e2e/test_e2e.py   # any pytest arguments
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
TIERS = {"all": [], "unit": ["-m", "not e2e"], "e2e": ["-m", "e2e"]}
CGROUP_ROOTS = (Path("/sys/fs/cgroup/cpuacct"), Path("/sys/fs/cgroup/unified"), Path("/sys/fs/cgroup"))
LEFTOVER_WAIT_S = 60


class CpuGroup:
    """A control group of its own for the measured command: its processes and their CPU seconds."""

    def __init__(self):
        root = next((r for r in CGROUP_ROOTS if (r / "cpuacct.usage").exists() or (r / "cpu.stat").exists()), None)
        if root is None:
            raise SystemExit(f"no cgroup CPU accounting under {', '.join(map(str, CGROUP_ROOTS))}: this needs Linux")
        self.path = root / f"rl_tpu_suite_{os.getpid()}"
        try:
            self.path.mkdir()
        except OSError as err:
            raise SystemExit(f"cannot make the control group {self.path} ({err}): this needs root") from err

    def enter(self) -> None:
        """Moves the calling process in (the command's, before it runs: its descendants follow)."""
        (self.path / "cgroup.procs").write_text(str(os.getpid()))

    def processes(self) -> list[int]:
        return [int(pid) for pid in (self.path / "cgroup.procs").read_text().split()]

    def cpu_seconds(self) -> float:
        if (self.path / "cpuacct.usage").exists():
            return int((self.path / "cpuacct.usage").read_text()) / 1e9
        stat = dict(line.split() for line in (self.path / "cpu.stat").read_text().splitlines())
        return int(stat["usage_usec"]) / 1e6

    def drain(self) -> list[str]:
        """Waits for what the command left running; what is still there after LEFTOVER_WAIT_S, by its command line."""
        deadline = time.monotonic() + LEFTOVER_WAIT_S
        while self.processes() and time.monotonic() < deadline:
            time.sleep(1)
        left = []
        for pid in self.processes():
            try:
                left.append(f"{pid} " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()[:120])
            except OSError:
                pass
        return left

    def remove(self) -> None:
        try:
            self.path.rmdir()
        except OSError:  # processes left in it: it goes with them
            pass


def summary_line(output: str) -> str:
    """pytest's last line: the counts and its own wall time."""
    lines = [line for line in output.splitlines() if re.search(r"\d+ (passed|failed)", line)]
    return lines[-1].strip("= ") if lines else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tier", choices=sorted(TIERS), default="all")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "suite_cost.json"))
    parser.add_argument("--log", help="pytest's output to this file (default: beside --out, .log)")
    parser.add_argument("pytest_args", nargs="*", help="after --: passed to pytest")
    args = parser.parse_args()
    group = CpuGroup()
    command = [sys.executable, "-m", "pytest", *TIERS[args.tier], *args.pytest_args]
    log = Path(args.log or Path(args.out).with_suffix(".log"))
    load, started = os.getloadavg(), time.monotonic()
    with open(log, "w") as sink:
        status = subprocess.run(
            command, cwd=REPO, stdout=sink, stderr=subprocess.STDOUT, preexec_fn=group.enter
        ).returncode
    wall = time.monotonic() - started
    leftovers = group.drain()
    cpu, cores = group.cpu_seconds(), os.cpu_count() or 1
    group.remove()
    write_record(
        args.out,
        load,
        command=" ".join(command[1:]),
        exit_status=status,
        pytest=summary_line(log.read_text()),
        wall_s=round(wall, 1),
        cpu_s=round(cpu, 1),
        cores=cores,
        cores_busy=round(cpu / wall, 2),  # the tree's average use of the cores
        floor_s=round(cpu / cores, 1),  # the wall time with every core busy all the time: no scheduling beats it
        left_running=leftovers,  # processes the command left behind (counted until they ended or the wait did)
    )
    print(f"wall {wall:.0f} s, CPU {cpu:.0f} s over {cores} cores: floor {cpu / cores:.0f} s")


if __name__ == "__main__":
    main()
