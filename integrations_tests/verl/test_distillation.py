"""On-policy distillation in verl 0.9.1: the teacher's log-probs that verl's own teacher loop writes into the batch
(``teacher_logprobs`` / ``teacher_ids``, ``[B, prompt + response, K]``) feed ``on_policy_distillation`` at verl's real
trainer-side ``compute_advantage``. The teacher servers themselves need GPUs: the batch is laid out as verl's agent
loop writes it (``_pad_teacher_outputs``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf

import stablerl
from stablerl.params import StableRLError

B, P, R, V = 6, 3, 5, 20


def _batch(K=1, seed=0, sampled_in_topk=True):
    from verl import DataProto

    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([5, 3, 1, 5, 4, 2])
    mask = (torch.arange(R).unsqueeze(0) < lengths.unsqueeze(1)).float()
    responses = torch.randint(0, V, (B, R), generator=g)
    prompts = torch.randint(0, V, (B, P), generator=g)
    old = -torch.rand(B, R, generator=g) * 2 * mask
    teacher = -torch.rand(B, R, generator=g) * 2
    seq = torch.cat([prompts, responses], 1)
    if K == 1:  # verl's k1/k2/k3 modes: the teacher's log-prob of each sequence token
        ids = seq.unsqueeze(-1)
        logprobs = torch.cat([torch.zeros(B, P), teacher], 1).unsqueeze(-1)
    else:  # forward_kl_topk: the teacher's top-k; the sampled token sits at a random slot among them
        ids = torch.randint(V, 2 * V, (B, P + R, K), generator=g)  # other ids than any sampled one
        logprobs = -torch.rand(B, P + R, K, generator=g) * 3 - 2
        slot = torch.randint(0, K, (B, R), generator=g)
        rows, cols = torch.meshgrid(torch.arange(B), torch.arange(R), indexing="ij")
        if sampled_in_topk:
            ids[rows, P + cols, slot] = responses
            logprobs[rows, P + cols, slot] = teacher
    data = DataProto.from_dict(
        tensors={"token_level_rewards": torch.zeros(B, R), "response_mask": mask, "responses": responses,
                 "old_log_probs": old, "teacher_logprobs": logprobs, "teacher_ids": ids.to(torch.int32)},
        non_tensors={"uid": np.array([0, 0, 0, 1, 1, 1], dtype=object)},
    )
    return data, old, teacher * mask, mask


def _compute(name, data, **extra):
    from verl.trainer.ppo.ray_trainer import compute_advantage

    config = OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                               "adv_estimator": name, "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False,
                               **extra})
    return compute_advantage(data, name, config=config).batch["advantages"]


@pytest.mark.parametrize("K", [1, 4])
def test_verls_teacher_logprobs_feed_the_distillation_advantage(adapter, K):
    data, old, teacher, mask = _batch(K=K)
    adv = _compute("on_policy_distillation", data, kl_coef=0.5)
    torch.testing.assert_close(adv, 0.5 * (teacher - old) * mask, rtol=1e-6, atol=1e-6)
    # with GRPO's task advantage added (the rewards: one score on the last token)
    data, old, teacher, mask = _batch(K=K, seed=1)
    scores = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0, 1.0])
    rewards = torch.zeros(B, R)
    rewards[torch.arange(B), mask.sum(-1).long() - 1] = scores
    data.batch["token_level_rewards"] = rewards
    grpo, _ = stablerl.compute_advantage("grpo", token_level_rewards=rewards, response_mask=mask,
                                         index=data.non_tensor_batch["uid"])
    adv = _compute("on_policy_distillation", data, task_estimator="grpo")
    torch.testing.assert_close(adv, grpo + (teacher - old) * mask, rtol=1e-5, atol=1e-5)


def test_a_topk_teacher_that_misses_sampled_tokens_is_refused(adapter):
    data, *_ = _batch(K=4, sampled_in_topk=False)
    with pytest.raises(StableRLError, match="sampled-token loss_mode"):
        _compute("on_policy_distillation", data)


def test_without_verls_teacher_loop_the_input_is_refused_naming_the_keys(adapter):
    data, *_ = _batch()
    data.pop(batch_keys=["teacher_logprobs", "teacher_ids"])
    with pytest.raises(stablerl.StableRLError, match="distillation.enabled"):
        _compute("on_policy_distillation", data)


def test_a_teacher_layout_of_another_tokenizer_is_refused(adapter):
    data, *_ = _batch()
    data.batch["teacher_logprobs"] = data.batch["teacher_logprobs"][:, :2]  # fewer positions than the response
    with pytest.raises(StableRLError, match="teacher_logprobs has shape"):
        _compute("on_policy_distillation", data)
