"""The reward pool: plugins that raise, hang, crash or return NaN are contained; verl plugin forms work."""

from __future__ import annotations

import textwrap
import time
from concurrent.futures import Future

import pytest

from rl_tpu.config import CustomRewardConfig, RewardConfig
from rl_tpu.grader.grader import WORKER_START_S, Grader, Grading, RewardError, Sample, reward_sources

PLUGIN = """
import asyncio, math, os, time

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "raise":
        raise RuntimeError("plugin bug on " + solution_str)
    if ground_truth == "sleep":
        time.sleep(60)
    if ground_truth == "nan":
        return math.nan
    if ground_truth == "exit":
        os._exit(3)
    if ground_truth == "dict":
        return {"score": 0.5, "exact": True, "pred": "not a number"}
    if ground_truth == "allocate":  # without bound: only the worker's memory limit stops it
        hoard = []
        while True:
            hoard.append(bytearray(64 * 2**20))
    if ground_truth == "spin":  # CPU-bound for longer than the sample's budget
        while True:
            pass
    if ground_truth == "env":
        return float(os.environ.get("RL_TPU_TEST_SECRET") == "s3cret") + 2 * float(os.environ.get("RL_TPU_TEST_KEPT") == "yes")
    if ground_truth == "chatty":  # 10 MB of prints a call
        print("x" * 10_000_000)
        import sys
        print("to stderr", file=sys.stderr)
    if ground_truth.startswith("type:"):
        import numpy, torch
        return {"bool": True, "np32": numpy.float32(0.25), "np_int": numpy.int64(1), "tensor": torch.tensor(0.5),
                "array1": numpy.array([0.75]), "array2": numpy.array([0.1, 0.2]), "string": "1.0"}[ground_truth[5:]]
    return 1.0 if solution_str == ground_truth else 0.0

async def async_score(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
    await asyncio.sleep(0.001)
    return (1.0 if solution_str == ground_truth else 0.0) + bonus

def batch_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
    return [float(s == g) for s, g in zip(solution_strs, ground_truths)]

def short_batch(data_sources, solution_strs, ground_truths, extra_infos):
    return [1.0]
"""


@pytest.fixture(scope="module")
def plugin(tmp_path_factory):
    path = tmp_path_factory.mktemp("plugins") / "my_reward.py"
    path.write_text(textwrap.dedent(PLUGIN))
    return path


def samples(truths: list[str], answer: str = "a") -> list[Sample]:
    return [Sample("src", answer, truth, {"index": 100 + i}) for i, truth in enumerate(truths)]


def grader_for(plugin, name="compute_score", **reward) -> Grader:
    reward.setdefault("num_workers", 2)
    return Grader(RewardConfig(custom=CustomRewardConfig(path=str(plugin), name=name), **reward))


def test_raise_timeout_nan_and_crash_score_zero_and_the_run_goes_on(plugin, caplog):
    grader = grader_for(plugin, timeout_s=1.0, max_failure_rate=0.5)
    truths = ["a", "raise", "a", "sleep", "nan", "b", "exit", "a"] + ["a"] * 8
    try:
        start = time.perf_counter()
        with caplog.at_level("WARNING"):
            grades = grader.grade(samples(truths))
        elapsed = time.perf_counter() - start
        assert elapsed < 20, "the hung sample was not cut off"
        kinds = {f.index: f.kind for f in grades.failures}
        assert kinds == {1: "exception", 3: "timeout", 4: "invalid", 6: "crash"}
        expected = [0.0 if i in kinds or t == "b" else 1.0 for i, t in enumerate(truths)]
        assert grades.scores == expected
        raised = next(f for f in grades.failures if f.kind == "exception")
        assert "RuntimeError: plugin bug on a" in raised.message and "my_reward.py" in raised.message
        assert "returned nan" in grades.failures[2].message
        metrics = grades.metrics("reward")
        assert metrics["reward/failed"] == 4 and metrics["reward/timeouts"] == 1
        assert "sample 3 (extra_info.index=103) scored 0 (timeout)" in caplog.text
        assert "sample 1 (extra_info.index=101) scored 0 (exception): RuntimeError: plugin bug on a" in caplog.text
        # the replaced workers serve the next batch
        assert grader.grade(samples(["a"] * 6)).scores == [1.0] * 6
    finally:
        grader.close()


def test_too_many_failures_stop_the_run_naming_the_plugin_and_traceback(plugin):
    grader = grader_for(plugin, max_failure_rate=0.25)
    try:
        assert len(grader.grade(samples(["a", "a", "a", "raise"])).failures) == 1  # 1 of 4 is allowed
        with pytest.raises(RewardError) as err:
            grader.grade(samples(["a", "raise", "a", "raise"]))
        text = str(err.value)
        assert "my_reward.py:compute_score" in text and "2 of 4 samples failed" in text
        assert "reward.max_failure_rate=0.25" in text and "RuntimeError: plugin bug on a" in text
    finally:
        grader.close()


def test_a_hung_plugin_stops_the_run_as_soon_as_the_failure_rate_cannot_be_met(plugin):
    """64 samples that hang, 1 s each, on two workers: the whole batch would take 32 s; the rate (10%: 6 allowed)
    is broken at the 7th timeout, about 4 s in. The pool is replaced and serves the next batch."""
    grader = grader_for(plugin, timeout_s=1.0, max_failure_rate=0.1)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError) as err:
            grader.grade(samples(["sleep"] * 64))
        assert time.monotonic() - start < 15
        text = str(err.value)
        assert "my_reward.py:compute_score" in text and "of 64 samples failed to score (" in text
        assert "more not scored: the batch was stopped there" in text and "timeout" in text
        assert grader.grade(samples(["a"] * 4)).scores == [1.0] * 4
    finally:
        grader.close()


def test_a_plugin_that_hangs_on_everything_stops_a_default_size_batch_after_a_few_timeouts(plugin):
    """512 samples (the default evaluation), 10% allowed: 52 timeouts would break the rate, but the first eight
    answers all failed, which stops the batch there: a few timeouts per worker, not 512 / 2 of them."""
    grader = grader_for(plugin, timeout_s=1.0, max_failure_rate=0.1)
    try:
        start = time.monotonic()
        with pytest.raises(RewardError, match=r"8 of 512 samples failed to score"):
            grader.grade(samples(["sleep"] * 512))
        assert time.monotonic() - start < 30  # 4 timeouts of 1 s per worker, and the workers' restarts
    finally:
        grader.close()
    # fewer failures than that at the start, whatever order they arrive in: judged by the rate alone
    grader = grader_for(plugin, timeout_s=1.0, max_failure_rate=0.5)
    try:
        grades = grader.grade(samples(["raise"] * 7 + ["a"] * 17))
        assert grades.scores == [0.0] * 7 + [1.0] * 17
    finally:
        grader.close()


def test_closing_during_a_hung_batch_returns_at_once_and_leaves_no_worker(plugin):
    """What a second SIGTERM does while a plugin hangs: the driver's cleanup does not wait for the batch."""
    grader = grader_for(plugin, timeout_s=30.0)
    processes = [worker.process for worker in grader.pool.workers]
    grading = grader.submit(samples(["sleep"] * 8))
    time.sleep(1.0)  # the workers are inside the plugin's sleep
    start = time.monotonic()
    grader.close()
    assert time.monotonic() - start < 2.0
    with pytest.raises(RewardError, match="not run: the pool was closed"):
        grading.future.result(timeout=10)
    assert all(process.poll() is not None for process in processes)


def test_a_plugins_output_goes_to_the_workers_log_capped(plugin, tmp_path):
    grader = Grader(RewardConfig(custom=CustomRewardConfig(path=str(plugin)), num_workers=2), log_dir=str(tmp_path))
    try:
        assert grader.grade(samples(["chatty"] * 6, answer="chatty")).scores == [1.0] * 6
    finally:
        grader.close()
    log = (tmp_path / "reward_workers.log").read_text()
    assert 2**20 <= len(log) < 2 * (2**20 + 1000)  # 60 MB printed; each of the two workers passed on 1 MiB
    assert log.count("printed more than its limit; the rest is dropped") == 2


def test_dict_results_log_their_numeric_fields(plugin):
    grader = grader_for(plugin)
    try:
        grades = grader.grade(samples(["dict", "dict", "a"]))
        assert grades.scores == [0.5, 0.5, 1.0]
        assert grades.extras == {"custom/exact": [1.0, 1.0]}  # the string field is not a metric
        assert grades.metrics("reward")["reward/extra/custom/exact"] == 1.0
    finally:
        grader.close()


@pytest.mark.parametrize("name, batched", [("async_score", False), ("batch_score", True)])
def test_async_and_batched_plugins(plugin, name, batched):
    grader = grader_for(plugin, name=name)
    try:
        assert grader.batched is batched
        assert grader.grade(samples(["a", "b"] * 5)).scores == [1.0, 0.0] * 5
    finally:
        grader.close()


def test_plugin_kwargs_reach_the_function(plugin):
    reward = RewardConfig(
        num_workers=1, custom=CustomRewardConfig(path=str(plugin), name="async_score", kwargs={"bonus": 0.25})
    )
    grader = Grader(reward)
    try:
        assert grader.grade(samples(["a", "b"])).scores == [1.25, 0.25]
    finally:
        grader.close()


def test_batched_plugin_with_wrong_length_fails_its_samples(plugin):
    grader = grader_for(plugin, name="short_batch", max_failure_rate=1.0)
    try:
        grades = grader.grade(samples(["a"] * 4))
        assert grades.scores == [0.0] * 4 and {f.kind for f in grades.failures} == {"invalid"}
        assert "returned 1 scores for" in grades.failures[0].message
    finally:
        grader.close()


def test_combined_builtins_are_a_weighted_sum():
    grader = Grader(RewardConfig(name="gsm8k", combine={"gsm8k": 1.0, "format": 0.1}, num_workers=1))
    try:
        assert grader.primary == "gsm8k"
        grades = grader.grade(
            [
                Sample("gsm8k", "#### 18", "18", {}),
                Sample("gsm8k", "#### 17", "18", {}),
                Sample("gsm8k", "it is 18", "18", {}),
            ]
        )
        assert grades.scores == pytest.approx([1.1, 0.1, 1.0])
        assert grades.components == {"gsm8k": [1.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0]}
    finally:
        grader.close()


def test_plugin_that_cannot_load_fails_at_start(tmp_path, plugin):
    with pytest.raises(RewardError, match="my_reward.py has no function 'nope'"):
        grader_for(plugin, name="nope")
    broken = tmp_path / "broken.py"
    broken.write_text("import not_a_module_anywhere\n")
    with pytest.raises(RewardError, match="ModuleNotFoundError: No module named 'not_a_module_anywhere'"):
        grader_for(broken)
    with pytest.raises(FileNotFoundError, match="missing.py .reward.custom.path. does not exist"):
        grader_for(tmp_path / "missing.py")


@pytest.mark.parametrize(
    "reward, alias, message",
    [
        (RewardConfig(name="gsm9k"), CustomRewardConfig(), "reward name 'gsm9k': allowed values are arithmetic, gsm8k"),
        (
            RewardConfig(name="math", combine={"format": 1.0}),
            CustomRewardConfig(),
            "must include the primary reward 'math'",
        ),
        (RewardConfig(combine={"custom": 1.0}), CustomRewardConfig(), "names 'custom' but no plugin is set"),
        (RewardConfig(custom=CustomRewardConfig(path="a.py")), CustomRewardConfig(path="b.py"), "set only one of them"),
    ],
)
def test_reward_config_errors_name_the_key(reward, alias, message):
    with pytest.raises(ValueError, match=message):
        reward_sources(reward, alias)


def test_verl_alias_names_the_plugin(plugin):
    (source,) = reward_sources(
        RewardConfig(custom=CustomRewardConfig(kwargs={"bonus": 1})),
        CustomRewardConfig(path=str(plugin), name="async_score"),
    )
    assert (source.label, source.path, source.function, source.kwargs) == (
        "custom",
        str(plugin),
        "async_score",
        (("bonus", 1),),
    )


def test_math_reward_runs_in_the_pool_with_its_own_timeouts():
    """math-verify uses SIGALRM, which works in a worker's main thread (not in the driver's grading thread)."""
    grader = Grader(RewardConfig(name="math", num_workers=2))
    try:
        grades = grader.submit(
            [
                Sample("math", "so $\\boxed{\\frac{1}{2}}$", "0.5", {}),
                Sample("math", "so $\\boxed{3}$", "\\sqrt{9}", {}),
                Sample("math", "so $\\boxed{(0,1)}$", "[0,1]", {}),
            ]
        ).result()
        assert grades.scores == [1.0, 1.0, 0.0] and not grades.failures
    finally:
        grader.close()


def test_a_plugin_that_allocates_without_bound_is_stopped_by_the_memory_limit(plugin):
    """The sample fails (MemoryError in its worker, counted), the host keeps its memory and the others score."""
    grader = grader_for(plugin, num_workers=1, worker_memory_mb=1024, max_failure_rate=0.5)
    try:
        grades = grader.grade(samples(["a", "allocate", "a", "a"]))
    finally:
        grader.close()
    assert grades.scores == [1.0, 0.0, 1.0, 1.0]
    (failure,) = grades.failures
    assert failure.index == 1 and "MemoryError" in failure.message


LARGE_IMPORT = """
import mmap
MAPPED = mmap.mmap(-1, 6 * 2**30)  # 6 GiB of address space at import, as a CUDA build of torch maps libraries

def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "allocate":
        hoard = []
        while True:
            hoard.append(bytearray(64 * 2**20))
    return 1.0
"""


def test_the_memory_limit_counts_from_what_the_plugin_holds_once_loaded(tmp_path):
    """A plugin whose imports hold more address space than the limit still loads; what it allocates after is capped."""
    path = tmp_path / "large_import.py"
    path.write_text(LARGE_IMPORT)
    grader = grader_for(path, num_workers=1, worker_memory_mb=1024, max_failure_rate=0.5)
    try:
        grades = grader.grade(samples(["a", "allocate", "a"]))
    finally:
        grader.close()
    assert grades.scores == [1.0, 0.0, 1.0]
    assert "MemoryError" in grades.failures[0].message


def test_a_cpu_bound_sample_is_stopped_by_the_cpu_limit(plugin):
    """RLIMIT_CPU (timeout_s + 1 s of CPU per sample) ends the worker even before the wall-clock deadline would."""
    grader = grader_for(plugin, num_workers=1, timeout_s=1.0, max_failure_rate=0.5)
    grader.pool.timeout_s = 60.0  # only the CPU limit is left to stop it
    start = time.monotonic()
    try:
        grades = grader.grade(samples(["spin", "a"]))
    finally:
        grader.close()
    assert grades.scores == [0.0, 1.0] and grades.failures[0].kind == "crash"
    assert time.monotonic() - start < 30


def test_workers_get_a_minimal_environment_unless_pass_env_names_more(plugin, monkeypatch):
    monkeypatch.setenv("RL_TPU_TEST_SECRET", "s3cret")
    monkeypatch.setenv("RL_TPU_TEST_KEPT", "yes")
    for pass_env, expected in (
        ([], 0.0),
        (["RL_TPU_TEST_KEPT"], 2.0),
        (["RL_TPU_TEST_SECRET", "RL_TPU_TEST_KEPT"], 3.0),
    ):
        grader = grader_for(plugin, num_workers=1, pass_env=pass_env)
        try:
            assert grader.grade(samples(["env"])).scores == [expected], pass_env
        finally:
            grader.close()


def test_scores_of_every_numeric_type_verl_accepts(plugin):
    grader = grader_for(plugin, num_workers=1, max_failure_rate=1.0)
    kinds = ["bool", "np32", "np_int", "tensor", "array1", "array2", "string"]
    try:
        grades = grader.grade(samples([f"type:{k}" for k in kinds]))
    finally:
        grader.close()
    assert grades.scores == [1.0, 0.25, 1.0, 0.5, 0.75, 0.0, 0.0]
    assert [f.index for f in grades.failures] == [5, 6]  # a two-element array and a string are not scores
    assert all(f.kind == "invalid" for f in grades.failures)


def alive(pid: int) -> bool:
    """Running, not merely waiting to be reaped."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_workers_die_with_the_process_that_started_them(tmp_path):
    """A driver killed outright (SIGKILL: no clean-up runs) while its rewards hang leaves no worker behind (an idle
    worker would see its pipe close; a busy one must be killed)."""
    import signal
    import subprocess
    import sys

    plugin = tmp_path / "hangs.py"
    plugin.write_text("import time\ndef compute_score(**kwargs):\n    time.sleep(600)\n")
    script = (
        "from rl_tpu.config import CustomRewardConfig, RewardConfig\n"
        "from rl_tpu.grader.grader import Grader, Sample\n"
        f"reward = RewardConfig(num_workers=2, timeout_s=600, custom=CustomRewardConfig(path={str(plugin)!r}))\n"
        "grader = Grader(reward)\n"
        "grader.submit([Sample('s', 'a', '1', {}) for _ in range(4)])\n"
        "print(*[w.process.pid for w in grader.pool.workers], flush=True)\n"
        "import time; time.sleep(600)\n"
    )
    driver = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    try:
        workers = [int(pid) for pid in driver.stdout.readline().split()]
        assert len(workers) == 2 and all(alive(pid) for pid in workers)
        time.sleep(1)  # both busy with a sample that sleeps
    finally:
        driver.send_signal(signal.SIGKILL)
        driver.wait()
    deadline = time.monotonic() + 10
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(alive(pid) for pid in workers)


def test_waiting_for_a_batch_has_a_deadline_that_names_the_rewards():
    stuck = Grading(Future(), samples=8, deadline_s=0.2, rewards="custom")  # a grader thread that never answers
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"reward custom: grading 8 samples gave no result within 0 s"):
        stuck.result()
    assert time.monotonic() - start < 5
    done = Future()
    done.set_result("grades")
    assert Grading(done, 1, 0.2, "custom").result() == "grades"


def test_a_batchs_deadline_covers_every_sample_timing_out_on_every_worker(plugin):
    grader = grader_for(plugin, timeout_s=5.0)
    try:
        grading = grader.submit(samples(["a"] * 9))
        assert grading.deadline_s >= 5 * (5.0 + WORKER_START_S)  # 5 samples on the busier worker
        assert grading.result().scores == [1.0] * 9
    finally:
        grader.close()
