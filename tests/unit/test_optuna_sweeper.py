"""`hydra/sweeper=optuna`: each search-space form gives its Optuna distribution, and a sweep run through Hydra
(tests/fixtures/optuna_app.py standing in for rl_tpu.main) runs its trials, records the failed ones as failed
and goes on, and writes optimization_results.yaml and the sweep's summary."""

from __future__ import annotations

import runpy
import subprocess
import sys

import pytest
import yaml
from conftest import REPO
from hydra.core.override_parser.overrides_parser import OverridesParser
from optuna.distributions import CategoricalDistribution, FloatDistribution, IntDistribution

from rl_tpu.outputs.report import FAILED_FILE, SUMMARY_FILE
from rl_tpu.sweeps.optuna_study import FORMS, RESULTS_FILE, SearchSpaceError, search_space

APP = REPO / "tests" / "fixtures" / "optuna_app.py"
SUMMARY_CALLBACK = "+hydra.callbacks.sweep_summary._target_=rl_tpu.outputs.report.SweepSummary"


@pytest.mark.parametrize(
    "text, expected",
    [
        ("interval(1e-5, 1e-4)", FloatDistribution(1e-5, 1e-4)),
        ("tag(log, interval(1e-6, 1e-4))", FloatDistribution(1e-6, 1e-4, log=True)),
        ("int(interval(4, 16))", IntDistribution(4, 16)),
        ("tag(log, int(interval(1, 64)))", IntDistribution(1, 64, log=True)),
        ("range(4, 16, 2)", IntDistribution(4, 14, step=2)),  # 16 excluded, as in Hydra's basic sweeper
        ("range(4, 8)", IntDistribution(4, 7)),
        ("choice(4, 8, 16)", CategoricalDistribution([4, 8, 16])),
        ("choice(adam, 'sgd momentum')", CategoricalDistribution(["adam", "sgd momentum"])),
        ("4,8", CategoricalDistribution([4, 8])),
    ],
)
def test_each_form_gives_its_distribution(text, expected):
    got = search_space({"algorithm.lr": text}, []).distributions["algorithm.lr"]
    assert type(got) is type(expected) and vars(got) == vars(expected), got


def test_range_offers_the_values_the_basic_sweeper_runs():
    for text in ("range(4, 16, 2)", "range(16, 4, -4)", "range(3, 10, 3)"):
        got = search_space({"k": text}, []).distributions["k"]
        basic = OverridesParser.create().parse_override(f"k={text}").sweep_iterator()
        assert set(range(got.low, got.high + 1, got.step)) == set(basic), text


@pytest.mark.parametrize(
    "text, why",
    [
        ("glob(*)", "Glob is not a search space"),
        ("interval(1e-5", "no viable alternative"),
        ("tag(log, interval(0, 1e-4))", "`low > 0` must hold for `log=True`"),
        ("tag(fast, interval(1, 2))", "unknown tag(s) ['fast']"),
        ("range(0.5, 2.0, 0.5)", "range takes integers"),
        ("range(4, 4)", "the range is empty"),
        ("choice([1, 2], [3])", "the choices must be numbers, strings or booleans"),
    ],
)
def test_a_bad_search_space_names_the_key_and_the_forms(text, why):
    with pytest.raises(SearchSpaceError) as raised:
        search_space({"algorithm.lr": text}, [])
    assert str(raised.value).startswith(f"algorithm.lr={text}: ") and why in str(raised.value)
    assert str(raised.value).endswith(f"a search space is one of {FORMS}")


def test_command_line_overrides_pass_through_or_join_the_search():
    space = search_space(
        {"algorithm.lr": "interval(1e-5, 1e-4)", "sampler.n": "choice(4, 8)", "seed": "3"},
        ["sampler.n=16", "trainer.total_steps=20", "data.ops='+-'", "actor.clip_ratio=0.1,0.2"],
    )
    assert space.fixed == {
        "seed": "seed=3",
        "sampler.n": "sampler.n=16",
        "trainer.total_steps": "trainer.total_steps=20",
        "data.ops": "data.ops='+-'",
    }  # the command line's sampler.n replaced the search
    assert space.distributions == {
        "algorithm.lr": FloatDistribution(1e-5, 1e-4),
        "actor.clip_ratio": CategoricalDistribution([0.1, 0.2]),
    }
    trial = space.overrides({"algorithm.lr": 2.5e-05, "actor.clip_ratio": 0.2, "data.name": "my data"})
    parsed = {o.get_key_element(): o.value() for o in OverridesParser.create().parse_overrides(trial)}
    assert parsed == {
        "seed": 3,
        "sampler.n": 16,
        "trainer.total_steps": 20,
        "data.ops": "+-",
        "algorithm.lr": 2.5e-05,
        "actor.clip_ratio": 0.2,
        "data.name": "my data",
    }


def app_value(lr: float, n: int) -> float:
    """What the stand-in app returns for these parameters."""
    return runpy.run_path(str(APP), run_name="optuna_app")["value"](lr, n)


def sweep(sweep_dir, *overrides: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(APP), "-m", "hydra/sweeper=optuna", f"hydra.sweep.dir={sweep_dir}", *overrides],
        cwd=sweep_dir.parent,
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_a_sweep_runs_its_trials_and_a_failed_one_does_not_stop_it(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = sweep(
        sweep_dir,
        "hydra.sweeper.n_trials=6",
        "hydra.sweeper.n_jobs=2",
        "hydra.sweeper.seed=0",
        "hydra.sweeper.params={lr: 'tag(log, interval(1e-5, 1e-4))'}",
        "n=4,8",
        "nan_jobs=[2]",
        "raise_jobs=[4]",
        SUMMARY_CALLBACK,
    )
    results = yaml.safe_load((sweep_dir / RESULTS_FILE).read_text())
    trials = results["trials"]
    assert [t["job"] for t in trials] == list(range(6)) and all((sweep_dir / str(j)).is_dir() for j in range(6))
    assert (done.stdout + done.stderr).count("Launching 2 jobs locally") == 3  # n_jobs trials per batch
    assert {t["job"]: t["state"] for t in trials if t["state"] != "COMPLETE"} == {2: "FAIL", 4: "FAIL"}
    for t in trials:
        ran = yaml.safe_load((sweep_dir / str(t["job"]) / ".hydra" / "overrides.yaml").read_text())
        assert f"n={t['params']['n']}" in ran and any(o.startswith("lr=") for o in ran)
        assert 1e-5 <= t["params"]["lr"] <= 1e-4 and t["params"]["n"] in (4, 8)
        if t["state"] == "COMPLETE":
            assert t["value"] == pytest.approx(app_value(**t["params"]))
    best = max((t for t in trials if t["state"] == "COMPLETE"), key=lambda t: t["value"])
    assert (results["best_value"], results["best_params"], results["best_trial"]) == (
        best["value"],
        best["params"],
        best["number"],
    )
    assert results["direction"] == "maximize"
    # the raised trial is recorded as the rl_tpu runs record theirs, so the summary lists it and the exit status is 1
    assert "job 4 raises, as asked" in (sweep_dir / "4" / FAILED_FILE).read_text()
    summary = (sweep_dir / SUMMARY_FILE).read_text()
    assert "| 4 | " in summary and "failed: ValueError: job 4 raises, as asked" in summary
    row = {t["job"]: summary.index(f"\n| {t['job']} | ") for t in trials}
    assert row[best["job"]] == min(row.values())  # ranked first
    assert done.returncode == 1 and "1 trial(s) of the sweep failed (4)" in done.stderr


def test_every_trial_failing_is_an_error_after_the_summary(tmp_path):
    sweep_dir = tmp_path / "sweep"
    done = sweep(
        sweep_dir,
        "hydra.sweeper.n_trials=2",
        "lr=interval(1e-5, 1e-4)",
        "nan_jobs=[0]",
        "inf_jobs=[1]",
        SUMMARY_CALLBACK,
    )
    assert done.returncode == 1 and "every trial of this sweep failed" in done.stderr
    results = yaml.safe_load((sweep_dir / RESULTS_FILE).read_text())
    assert results["best_value"] is None and [t["state"] for t in results["trials"]] == ["FAIL", "FAIL"]
    assert (sweep_dir / SUMMARY_FILE).is_file()


def test_a_stored_study_resumes(tmp_path):
    storage = f"sqlite:///{tmp_path / 'study.db'}"
    runs = []
    for name, n_trials in (("first", 3), ("second", 2)):
        done = sweep(
            tmp_path / name,
            f"hydra.sweeper.n_trials={n_trials}",
            "hydra.sweeper.study_name=lr",
            f"hydra.sweeper.storage='{storage}'",
            "hydra.sweeper.sampler=random",
            "lr=interval(1e-5, 1e-4)",
        )
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(yaml.safe_load((tmp_path / name / RESULTS_FILE).read_text())["trials"])
    first, second = runs
    assert [t["number"] for t in second] == [0, 1, 2, 3, 4]
    assert [t.get("job") for t in second] == [None, None, None, 0, 1]  # the earlier sweep's trials, then this one's
    assert [t["params"] for t in second[:3]] == [t["params"] for t in first]
