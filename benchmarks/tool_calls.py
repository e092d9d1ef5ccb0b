"""Tool calls at once: a turn's calls through the tool workers, one call at a time per worker against
`episode.tool_calls_per_worker` at once.

Two tools, each taking `--latency` seconds a call: one that awaits (`asyncio.sleep`: a remote environment, a
sandbox, a search) and one that blocks (`time.sleep` in an async `execute`: a synchronous client). A turn is
`--calls` calls over 2 workers (the defaults). Reports the median seconds of a turn over `--repeats`.

    python benchmarks/tool_calls.py   # about 2 minutes; writes results/tool_calls.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from rl_tpu.episodes.tool_worker import ToolCall
from rl_tpu.episodes.tools import ToolBox, ToolSettings

TOOLS = """
import asyncio
import time
from verl.tools.base_tool import BaseTool
from verl.tools.schemas import ToolResponse

class Awaits(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        await asyncio.sleep(parameters["seconds"])
        return ToolResponse(text="ok"), 0.0, {}

class Blocks(BaseTool):
    async def execute(self, instance_id, parameters, **kwargs):
        time.sleep(parameters["seconds"])
        return ToolResponse(text="ok"), 0.0, {}
"""


def tools_yaml(
    folder: Path, source: str = TOOLS, module: str = "latency_tools", classes: tuple[str, ...] = ("Awaits", "Blocks")
) -> str:
    """A tools YAML naming each class of the Python `source`, written to `folder` as `module`.py: the benchmarks'
    verl tools, each a function named after its class in lower case."""
    (folder / f"{module}.py").write_text(source)
    entries = [
        {
            "class_name": f"{module}.{name}",
            "config": {"type": "native"},
            "tool_schema": {"type": "function", "function": {"name": name.lower(), "description": name}},
        }
        for name in classes
    ]
    (folder / "tools.yaml").write_text(json.dumps({"tools": entries}))
    return str(folder / "tools.yaml")


def turn_seconds(box: ToolBox, tool: str, calls: int, latency: float, repeats: int) -> float:
    batch = [ToolCall(tool, json.dumps({"seconds": latency}), {})] * calls
    box.run(batch[: 2 * box.pool.size])  # warm-up: every worker has answered once
    times = []
    for _ in range(repeats):
        results, seconds = box.run(batch)
        assert all(r.failure is None for r in results), results
        times.append(seconds)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=64, help="calls in a turn (episodes calling at once)")
    parser.add_argument("--latency", type=float, default=0.25, help="seconds a call takes")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "benchmarks" / "results" / "tool_calls.json")
    args = parser.parse_args()
    load_before = os.getloadavg()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        yaml = tools_yaml(Path(folder))
        for per_worker in (1, 32):
            box = ToolBox(ToolSettings(yaml, None, 2, 60.0, 2048, 256, calls_per_worker=per_worker))
            try:
                for tool in ("awaits", "blocks"):
                    seconds = turn_seconds(box, tool, args.calls, args.latency, args.repeats)
                    rows.append({"tool": tool, "calls_per_worker": per_worker, "turn_s": seconds})
                    print(f"{tool}, {per_worker} a worker: {args.calls} calls of {args.latency} s in {seconds:.2f} s")
            finally:
                box.close()
    write_record(args.out, load_before, calls=args.calls, latency_s=args.latency, workers=2, results=rows)


if __name__ == "__main__":
    main()
