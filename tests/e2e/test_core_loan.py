"""Idle engine cores lent to the trainer (who gets which loan: tests/unit/test_cpu_binding.py): the engines'
activity files, and the rank's widening and narrowing (in a child process: pinning changes every thread of the
process it runs in)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from rl_tpu.cluster.core_loan import Borrower
from rl_tpu.cluster.cores import CoreLoan, CpuBinding

PROBE = """
import json, os, sys, time
import torch
from rl_tpu.cluster.core_loan import Borrower, EngineActivity
from rl_tpu.cluster.cores import CoreLoan, CpuBinding

folder = sys.argv[1]
binding = CpuBinding(threads=1, cores=(0,), loan=CoreLoan(cores=(1,), engines=(0,), folder=folder))
borrower = Borrower(binding, binding.apply("trainer_0"))
states = {}

def look(name):
    borrower.poll()
    torch.ones(256, 256) @ torch.ones(256, 256)  # the pool's threads exist at its new size
    masks = {tuple(sorted(os.sched_getaffinity(int(t)))) for t in os.listdir("/proc/self/task")}
    states[name] = {"wide": borrower.wide, "threads": torch.get_num_threads(), "masks": len(masks),
                    "cpus": len(os.sched_getaffinity(0))}

look("engine not started")
engine = EngineActivity(folder, 0)
look("engine idle")
time.sleep(0.05)
with engine:
    with engine:  # a generation and an install at once
        look("engine busy")
    look("one call still running")
look("engine idle again")
seconds = borrower.take_wide_seconds()
engine.close()
look("engine gone")
states["wide_seconds"] = seconds
states["folder_left"] = os.path.exists(str(engine.path.parent))
print(json.dumps(states))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to lend one")
def test_a_rank_widens_onto_the_engine_cores_only_while_the_engine_is_idle(tmp_path):
    folder = f"rl_tpu-test-{os.getpid()}"
    out = subprocess.run([sys.executable, "-c", PROBE, folder], capture_output=True, text=True, check=True)
    states = json.loads(out.stdout.strip().splitlines()[-1])
    narrow = {"wide": False, "threads": 1, "masks": 1, "cpus": 1}
    wide = {"wide": True, "threads": 2, "masks": 1, "cpus": 2}
    assert states["engine not started"] == narrow  # no file yet: counted busy
    assert states["engine idle"] == wide
    assert states["engine busy"] == narrow and states["one call still running"] == narrow
    assert states["engine idle again"] == wide
    assert states["engine gone"] == narrow and not states["folder_left"]
    assert 0.05 <= states["wide_seconds"] < 30


def test_a_rank_with_a_loan_polls_before_each_blocks_forward_and_after_its_backward(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    layers = model.config.num_hidden_layers
    for loan, expected in ((None, 0), (CoreLoan((1,), (0,), "unused"), 2 * layers)):
        borrower = Borrower(CpuBinding(threads=1, cores=(0,), loan=loan), node_cpus=[0, 1])
        polls = []
        borrower.poll = lambda: polls.append(1)
        borrower.attach(model)
        model(torch.tensor([[1, 2, 3]])).logits.sum().backward()
        assert len(polls) == expected, loan
        with torch.no_grad():  # evaluation: no backward to poll after
            model(torch.tensor([[1, 2, 3]]))
        assert len(polls) == expected + (layers if loan else 0)


COMPILED = """
import json, sys
import torch
from rl_tpu.config import RunConfig
from rl_tpu.cluster.core_loan import EngineActivity
from rl_tpu.cluster.cores import CoreLoan, CpuBinding
from rl_tpu.records import TrainBatch
from rl_tpu.trainer.worker import TrainerWorker

model_dir, folder, port = sys.argv[1], sys.argv[2], int(sys.argv[3])
cfg = RunConfig()
cfg.device, cfg.trainer.compile, cfg.trainer.borrow_idle_cores, cfg.trainer.micro_batch_size = "cpu", True, True, 4
cfg.algorithm.lr = 0.0  # the same weights at every step, so every step's loss and gradient can be compared
engine = EngineActivity(folder, 0)
binding = CpuBinding(threads=1, cores=(0,), loan=CoreLoan(cores=(1,), engines=(0,), folder=folder))
worker = TrainerWorker(cfg, model_dir, 0, 1, "127.0.0.1", port, binding=binding)
prompts = [[5, 6, 7, 8, 9, 10][: 3 + g] for g in range(3) for _ in range(4)]  # 3 groups of 4 share a prompt
completions = [[11 + i, 12, 13, 14, 15][: 1 + i % 5] for i in range(12)]
batch = TrainBatch(prompts, completions, [[-1.5] * len(c) for c in completions],
                   [[(-1.0) ** i] * len(c) for i, c in enumerate(completions)], 1.0)
steps = []
for busy in (True, False, True, False):
    if busy:
        engine.__enter__()
    metrics = worker.train_step(batch)
    if busy:
        engine.__exit__()
    steps.append({"busy": busy, "loss": metrics["actor/loss"], "grad_norm": metrics["actor/grad_norm"],
                  "borrowed": metrics["time/trainer_borrowed_s"],
                  "graphs": torch._dynamo.utils.counters["stats"]["unique_graphs"]})
worker.shutdown()
engine.close()
print(json.dumps(steps))
"""


@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs 2 CPUs to lend one")
def test_a_compiled_rank_compiles_each_width_once_and_computes_the_same_at_both(tiny_model_dir):
    """trainer.compile with a loan: narrow, wide, narrow, wide steps on one batch at lr 0. The second width
    compiles new graphs once; after that switching compiles nothing, and every step's loss and gradient agree."""
    from conftest import free_port

    folder = f"rl_tpu-test-compiled-{os.getpid()}"
    out = subprocess.run(
        [sys.executable, "-c", COMPILED, str(tiny_model_dir), folder, str(free_port())],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    narrow, wide, narrow_again, wide_again = json.loads(out.stdout.strip().splitlines()[-1])
    assert narrow["borrowed"] == 0 and narrow_again["borrowed"] == 0
    assert wide["borrowed"] > 0 and wide_again["borrowed"] > 0
    assert wide["graphs"] > narrow["graphs"] > 0  # the wide thread count compiled graphs of its own
    assert narrow_again["graphs"] == wide_again["graphs"] == wide["graphs"]  # and nothing compiles again
    for step in (wide, narrow_again, wide_again):
        assert step["loss"] == pytest.approx(narrow["loss"], rel=1e-5, abs=1e-6)
        assert step["grad_norm"] == pytest.approx(narrow["grad_norm"], rel=1e-5)
