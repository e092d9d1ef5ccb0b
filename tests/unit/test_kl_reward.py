"""KL in the reward: verl's penalty and controllers, the trainer's per-token KL, and the coefficient across a resume."""

from __future__ import annotations

import pytest
import torch
from conftest import free_port, make_batch

from rl_tpu.algorithms import core as algorithms
from rl_tpu.algorithms import kl_reward
from rl_tpu.algorithms.kl_reward import KLInReward
from rl_tpu.config import AlgorithmConfig, KLControlConfig, RunConfig
from rl_tpu.outputs import checkpoints
from rl_tpu.trainer.worker import TrainerWorker


def verl_kl_penalised(scores, old, ref, lengths, ctrl: KLControlConfig, estimator: str, steps: int):
    """verl's `ray_trainer.apply_kl_penalty`, step by step from verl's parts (that module needs torchdata, which
    rl_tpu does not install), `steps` times on the same batch: its token rewards and coefficients."""
    from verl.trainer.ppo import core_algos
    from verl.utils.torch_functional import masked_mean

    token_scores, mask = algorithms.token_level(scores, lengths)
    controller, coefs, rewards = core_algos.get_kl_controller(ctrl), [], None
    for _ in range(steps):
        kld = core_algos.kl_penalty(old, ref, kl_penalty=estimator) * mask
        coefs.append(controller.value)
        rewards = token_scores - controller.value * kld
        controller.update(
            current_kl=torch.mean(masked_mean(kld, mask=mask, axis=-1), dim=0).item(), n_steps=len(scores)
        )
    return rewards, coefs + [controller.value]


@pytest.mark.parametrize("ctrl", [KLControlConfig(), KLControlConfig("adaptive", 0.05, 40, 0.01)])
@pytest.mark.parametrize("estimator", ["kl", "low_var_kl", "mse", "abs"])
def test_penalties_and_controller_equal_verls_apply_kl_penalty(ctrl, estimator):
    from verl.trainer.ppo.core_algos import kl_penalty

    gen = torch.Generator().manual_seed(0)
    lengths = [3, 5, 1, 4, 5, 2]
    scores = [1.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    mask = algorithms.token_level(scores, lengths)[1]
    old = -torch.rand(6, 5, generator=gen) * 2 * mask
    ref = -torch.rand(6, 5, generator=gen) * 2 * mask
    verl_rewards, verl_coefs = verl_kl_penalised(scores, old, ref, lengths, ctrl, estimator, steps=3)
    token_kl = [kl_penalty(old, ref, estimator)[i, :n].tolist() for i, n in enumerate(lengths)]
    algo = AlgorithmConfig(use_kl_in_reward=True, kl_penalty=estimator, kl_ctrl=ctrl)
    ours, coefs = KLInReward(algo), []
    for _ in range(3):
        penalties, metrics = ours.penalties(token_kl)
        coefs.append(metrics["actor/reward_kl_penalty_coeff"])
    assert coefs + [ours.coef] == pytest.approx(verl_coefs, rel=1e-6)
    if ctrl.type == "adaptive":
        assert ours.coef != ctrl.kl_coef
    # the advantages of the penalised token rewards: ours from the penalties, verl's from its rewards
    groups = [0, 0, 0, 1, 1, 1]
    ours_adv = algorithms.advantages(scores, groups, lengths, algo, token_penalties=penalties)
    import numpy as np
    from verl.trainer.ppo.core_algos import compute_grpo_outcome_advantage

    verl_adv, _ = compute_grpo_outcome_advantage(verl_rewards, mask, np.asarray(groups))
    for row, n in enumerate(lengths):
        assert ours_adv[row] == pytest.approx(verl_adv[row, :n].tolist(), rel=1e-5, abs=1e-6)
    assert ours_adv != algorithms.advantages(scores, groups, lengths, algo)  # the penalty moved them


def test_bad_kl_settings_name_the_key():
    with pytest.raises(ValueError, match=r"algorithm.kl_penalty='k7': allowed values are kl, k1"):
        kl_reward.validate(AlgorithmConfig(kl_penalty="k7"))
    with pytest.raises(ValueError, match=r"algorithm.kl_ctrl.type='pid': allowed values are fixed, adaptive"):
        kl_reward.validate(AlgorithmConfig(kl_ctrl=KLControlConfig(type="pid")))
    with pytest.raises(ValueError, match=r"horizon > 0 and target_kl > 0 \(got 0, 0.1\)"):
        kl_reward.validate(AlgorithmConfig(kl_ctrl=KLControlConfig(type="adaptive", horizon=0)))


def test_a_resumed_controller_continues_with_the_saved_coefficient(tmp_path):
    algo = AlgorithmConfig(kl_ctrl=KLControlConfig("adaptive", 0.1, 10, 0.01))
    before = KLInReward(algo)
    before.penalties([[0.5, 0.5], [0.2]])
    for name, text in checkpoints.driver_files(4, before.coef).items():
        (tmp_path / name).write_text(text)
    assert KLInReward(algo, checkpoints.kl_coef(tmp_path)).coef == before.coef != 0.1
    assert checkpoints.kl_coef(None) is None  # the run starts: the configured coefficient
    # a checkpoint without it (a run without KL in the reward, or one cut short) is refused, never guessed
    (tmp_path / checkpoints.KL_COEF).unlink()
    with pytest.raises(FileNotFoundError, match=f"{tmp_path} has no kl_ctrl.json .*algorithm.use_kl_in_reward"):
        checkpoints.kl_coef(tmp_path)


def test_the_trainers_token_kl_is_zero_before_an_update_and_the_estimators_after(tiny_model_dir):
    """The reference is the initial weights: the policy that sampled the first batch has KL 0 to it; after an
    update the trainer's KL is verl's estimator of the logprobs of the new policy and the initial one."""
    from transformers import AutoModelForCausalLM
    from verl.trainer.ppo.core_algos import kl_penalty

    from rl_tpu.models.logprobs import pad_batch, token_logprobs

    cfg = RunConfig()
    cfg.device, cfg.algorithm.lr, cfg.trainer.micro_batch_size, cfg.sampler.n = "cpu", 1e-3, 3, 4
    cfg.algorithm.use_kl_in_reward, cfg.algorithm.kl_penalty = True, "low_var_kl"
    batch = make_batch()
    threads = torch.get_num_threads()
    worker = TrainerWorker(cfg, str(tiny_model_dir), 0, 1, "127.0.0.1", free_port())
    try:
        first = worker.token_kl(batch)
        worker.train_step(batch)
        after = worker.token_kl(batch)
        trained = worker.full_state_dict()
    finally:
        worker.shutdown()
        torch.set_num_threads(threads)
    assert [len(row) for row in first] == [len(c) for c in batch.completion_ids]
    assert all(kl == 0.0 for row in first for kl in row)
    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    policy.load_state_dict(trained)
    t = pad_batch(batch, pad_id=1, device=torch.device("cpu"), share_prompts=True)  # the trainer's layout
    with torch.no_grad():
        expected = kl_penalty(
            token_logprobs(policy, t, batch.temperature)[0],
            token_logprobs(initial, t, batch.temperature)[0],
            "low_var_kl",
        )
    # KL values up to 10 (the clamp): relative; CPU kernels differ by up to 2.1e-6 of a KL (1.3e-6 on an AMX host)
    for row, kls in enumerate(after):
        assert kls == pytest.approx(expected[row, : len(kls)].tolist(), rel=2e-5, abs=1e-6)
    assert max(kl for row in after for kl in row) > 1e-4
