"""Reference reward curves for the learning regression test, and the check against them.

    python benchmarks/learning_curves.py record [--seeds 3]        # writes tests/fixtures/learning_curves.json
    python benchmarks/learning_curves.py check [--cases vanilla,gspo,cispo,lr_zero:vanilla] [--out OUT.json]

Both run the same sweep: the `learning_digits` recipe (tests/fixtures/configs), one trial per case of
`+learning_case` (a loss mode, or the broken `lr_zero`), two trials at a time on a local Ray cluster.
A curve is compared in blocks of `BLOCK` steps (their mean reward). `record` runs it once per sampler
seed and keeps, per case, every seed's curve, the seeds' mean block by block, and the band around it:
the larger of `FLOOR` and 3 standard deviations of the seeds' block means. `check` runs seed 0 and says,
for each case (`CASE:REFERENCE` compares a case with another case's curve), whether every block stays
within the band, and if not where and by how much the curve moved; it exits 1 when one does not.
Re-record after a change that is meant to move the curves, and say why in the commit.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

from record import write_record  # beside this script

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "tests" / "fixtures" / "configs"
REFERENCE = REPO / "tests" / "fixtures" / "learning_curves.json"
CASES = ("vanilla", "gspo", "cispo")  # the loss modes held to their curves
BLOCK = 3  # steps averaged into one point of a compared curve
FLOOR = 0.06  # the narrowest band: noise that a machine of another kind may add to a seed's curve


def run_sweep(sweep_dir: Path, cases: list[str], seed: int) -> dict[str, list[float]]:
    """Each case's reward/mean by step, from one sweep (trial i runs cases[i]) in a fresh `sweep_dir`."""
    shutil.rmtree(sweep_dir, ignore_errors=True)
    command = [
        sys.executable,
        "-m",
        "rl_tpu.main",
        "-m",
        f"hydra.searchpath=[file://{CONFIGS}]",
        "+recipe=learning_digits",
        f"+learning_case={','.join(cases)}",
        "hydra/launcher=ray",
        "ray.num_cpus=4",
        f"sampler.seed={seed}",
        f"hydra.sweep.dir={sweep_dir}",
        f"cache_dir={sweep_dir / 'cache'}",
    ]
    subprocess.run(command, cwd=REPO, check=True, timeout=1800, stdout=subprocess.DEVNULL)
    curves = {}
    for i, case in enumerate(cases):
        rows = [json.loads(line) for line in (sweep_dir / str(i) / "metrics.jsonl").read_text().splitlines()]
        curves[case] = [r["reward/mean"] for r in rows if "reward/mean" in r]
    return curves


def blocks(curve: list[float], size: int = BLOCK) -> list[float]:
    return [statistics.fmean(curve[i : i + size]) for i in range(0, len(curve) - size + 1, size)]


def compare(case: str, curve: list[float], reference_case: str, reference: dict) -> dict:
    """Whether `curve` stays in `reference_case`'s band, block by block, and how far it moved."""
    recorded = reference["cases"][reference_case]
    got, size = blocks(curve, reference["block"]), reference["block"]
    moved = [g - m for g, m in zip(got, recorded["mean"])]
    worst = max(range(len(moved)), key=lambda i: abs(moved[i]) - recorded["band"][i])
    ok = len(got) == len(recorded["mean"]) and all(abs(d) <= b for d, b in zip(moved, recorded["band"]))
    where = f"steps {worst * size + 1}-{(worst + 1) * size}"
    message = (
        f"{case}: the reward curve stays within the band around {reference_case}'s recorded curve "
        f"(largest move {moved[worst]:+.3f} at {where}, band {recorded['band'][worst]:.3f})"
        if ok
        else f"{case}: the reward curve left the band around {reference_case}'s recorded curve: it moved "
        f"{moved[worst]:+.3f} at {where} (band {recorded['band'][worst]:.3f}); block means "
        f"{[round(g, 3) for g in got]}, recorded {[round(m, 3) for m in recorded['mean']]}"
    )
    return {
        "case": case,
        "reference": reference_case,
        "ok": ok,
        "moved": moved,
        "blocks": got,
        "curve": curve,
        "message": message,
    }


def record(seeds: int, work: Path) -> None:
    load_before, started = os.getloadavg(), time.monotonic()
    per_seed = [run_sweep(work / f"seed_{seed}", list(CASES), seed) for seed in range(seeds)]
    reference = {"block": BLOCK, "command": f"python benchmarks/learning_curves.py record --seeds {seeds}", "cases": {}}
    for case in CASES:
        seed_blocks = [blocks(curves[case]) for curves in per_seed]
        mean = [statistics.fmean(b) for b in zip(*seed_blocks)]
        spread = [statistics.stdev(b) if len(b) > 1 else 0.0 for b in zip(*seed_blocks)]
        reference["cases"][case] = {
            "mean": mean,
            "band": [max(FLOOR, 3 * s) for s in spread],
            "seeds": [curves[case] for curves in per_seed],
        }
        print(f"{case}: block means {[round(m, 3) for m in mean]}, seeds' std {[round(s, 3) for s in spread]}")
    REFERENCE.write_text(json.dumps(reference, indent=1) + "\n")
    print(f"wrote {REFERENCE}")
    write_record(
        REPO / "benchmarks" / "results" / "learning_curves.json",
        load_before,
        **reference,
        wall_s=time.monotonic() - started,
    )


def check(cases: list[str], work: Path, out: Path | None) -> bool:
    reference = json.loads(REFERENCE.read_text())
    pairs = [c.split(":") if ":" in c else (c, c) for c in cases]
    curves = run_sweep(work, [case for case, _ in pairs], seed=0)
    results = [compare(case, curves[case], ref, reference) for case, ref in pairs]
    for result in results:
        print(result["message"])
    if out:
        out.write_text(json.dumps(results, indent=1) + "\n")
    return all(r["ok"] for r in results)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.strip().splitlines()[0])
    parser.add_argument("mode", choices=("record", "check"))
    parser.add_argument("--seeds", type=int, default=3, help="record: sampler seeds 0..N-1")
    parser.add_argument("--cases", default=",".join(CASES), help="check: CASE or CASE:REFERENCE, comma-separated")
    parser.add_argument("--work", type=Path, default=Path("/tmp/rl_tpu_learning_curves"))
    parser.add_argument("--out", type=Path, help="check: the results as JSON")
    args = parser.parse_args()
    if args.mode == "record":
        record(args.seeds, args.work)
    elif not check(args.cases.split(","), args.work, args.out):
        sys.exit(1)


if __name__ == "__main__":
    main()
