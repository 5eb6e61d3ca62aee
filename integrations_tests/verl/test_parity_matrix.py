"""verl's column of the cross-framework parity matrix (see integrations_tests/parity/parity_matrix.py).

The shared batch goes through verl 0.9.1's real call sites: the worker-side loss
``verl.workers.utils.losses.ppo_loss`` (jagged log-probs over prompt + response, as an engine worker
hands them; declared inputs gathered by the adapter's wrapper from ``model_output`` and the batch)
and the trainer-side ``verl.trainer.ppo.ray_trainer.compute_advantage`` (a DataProto with uids).
Hyper-parameters go where a verl user sets them: the actor keys (clip_ratio_low/high/c, tau_pos/neg)
and ``+policy_loss`` / ``+algorithm`` keys; ``parity_matrix.SETTINGS``: all of them, or none.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

pytest.importorskip("verl")

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))

import parity_matrix as M  # noqa: E402

import stablerl  # noqa: E402
from stablerl.frameworks import get_framework  # noqa: E402

FRAMEWORK = "verl"
ALGORITHMS = M.matrix_algorithms()
results = M.Results.fixture(FRAMEWORK)


def _nt(rows):
    return torch.nested.as_nested_tensor(rows, layout=torch.jagged)


def _worker_batch(b, old_entropy=False):
    """What an engine worker hands to ``ppo_loss``: jagged response fields, uids, global batch info,
    and the model output (log-probs and entropies over prompt + response) with its leaves.
    ``old_entropy``: also the v1 trainer's old-log-prob pass entropy (only for a loss that requires it: verl
    would also hand it to steer, which reads it when present and which TRL and OpenRLHF do not give it)."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._inputs import VERSION_KEY

    P, R = b["prompt_lengths"], b["response_lengths"]

    def rows(key):
        return [b[key][i, :r] for i, r in enumerate(R)]

    def over_prompt(key):  # position p - 1 + t predicts response token t; the prompt part is filler
        return [torch.cat([torch.full((p - 1,), -0.5), b[key][i, :r], torch.full((1,), -0.5)]) for i, (p, r) in
                enumerate(zip(P, R))]

    token_scores = [F.pad(torch.zeros(r - 1), (0, 1), value=float(b["scores"][i])) for i, r in enumerate(R)]
    old_pass = {"entropy": _nt(rows("old_entropy"))} if old_entropy else {}  # v1's old-log-prob pass writes it
    data = TensorDict({
        "prompts": _nt([torch.arange(p) + 1 for p in P]),
        "responses": _nt(rows("token_ids")),
        "response_mask": _nt([torch.ones(r) for r in R]),
        "old_log_probs": _nt(rows("old_log_prob")),
        "advantages": _nt(rows("advantages")),
        "rollout_log_probs": _nt(rows("rollout_log_prob")),
        "token_level_scores": _nt(token_scores),
        **old_pass,
    }, batch_size=[len(R)])
    data["uid"] = NonTensorStack.from_list([NonTensorData(f"g{int(i)}") for i in b["index"]])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=int(sum(R)), global_batch_size=len(R))
    # the legacy trainer's weight-version mark (the adapter's _update_actor wrap writes it): A-3PO's one version
    tu.assign_non_tensor(data, **{VERSION_KEY: int(b["policy_version"]) - 1})
    leaves = [x.clone().requires_grad_(True) for x in over_prompt("log_prob")]
    model_output = {"log_probs": _nt(leaves), "entropy": _nt(over_prompt("entropy"))}
    return data, model_output, leaves


def _padded_grad(grads, b):
    out = torch.zeros_like(b["log_prob"])
    for i, (g, p, r) in enumerate(zip(grads, b["prompt_lengths"], b["response_lengths"])):
        out[i, :r] = g[p - 1 : p - 1 + r]
    return out


def _actor_config(adapter, name, mode, params, rollout_n=1):
    from verl.workers.config import FSDPActorConfig

    verl_keys = get_framework(FRAMEWORK).hyperparameter_keys[M.POLICY_LOSS]
    actor, verl_fields, own = {}, {}, {}
    for key, value in params.items():
        declared = verl_keys.get(key)
        if declared is None:
            own[key] = value  # +actor_rollout_ref.actor.policy_loss.<key>
        elif ".policy_loss." in declared.key:
            verl_fields[key] = value  # a verl PolicyLossConfig field's name: +...policy_loss.stablerl_params={key: v}
        else:
            actor[key] = value  # actor_rollout_ref.actor.<key>
    if verl_fields:
        own["stablerl_params"] = verl_fields
    loss_mode = M.selection_name(FRAMEWORK, stablerl.get_spec(M.POLICY_LOSS, name))
    return FSDPActorConfig(
        # rollout_n: the batch's group size (a loss that takes groups checks each group is whole)
        strategy="fsdp", rollout_n=rollout_n, ppo_micro_batch_size_per_gpu=2, calculate_entropy=True,
        loss_agg_mode=mode, entropy_coeff=0.0, use_kl_loss=False, **actor,
        policy_loss=adapter.StablePolicyLossConfig(loss_mode=loss_mode, **own),
    )


def _through_ppo_loss(adapter, name, b, mode, params):
    from stablerl.adapters.verl import _inputs
    from verl.workers.utils.losses import ppo_loss

    adapter.instrument()  # registers the names and wraps verl's call sites (idempotent; the entry point does it)
    _inputs.verl_adapter().state.loss.clear()  # fresh controller state, as the core call has
    data, model_output, leaves = _worker_batch(b, "old_entropy" in stablerl.get_spec(M.POLICY_LOSS, name).requires)
    group_size = int(torch.unique(torch.as_tensor(b["index"]), return_counts=True)[1].max())
    loss, _ = ppo_loss(_actor_config(adapter, name, mode, params, rollout_n=group_size), model_output, data)
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(leaf) if g is None else g for g, leaf in zip(grads, leaves)]
    return loss.detach(), _padded_grad(grads, b)


def _through_compute_advantage(name, b, params):
    from omegaconf import OmegaConf, open_dict
    from verl import DataProto
    from verl.trainer.ppo.ray_trainer import compute_advantage

    from stablerl.adapters.verl._advantage import KEPT_ENTROPY

    params = dict(params)
    norm = params.pop("norm_adv_by_std_in_grpo", True)  # verl's AlgoConfig default when not set
    if params.pop(M.NO_STD_KNOB, False):  # verl's knob is the same key
        norm = False
    algorithm = OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                                  "adv_estimator": name, "norm_adv_by_std_in_grpo": norm, "use_kl_in_reward": False})
    OmegaConf.set_struct(algorithm, True)
    with open_dict(algorithm):  # what `+algorithm.<key>=<value>` does
        for k, v in params.items():
            algorithm[k] = v
    # verl's old-log-prob pass's batch fields (old_log_probs, sum_pi_squared: optimal_token_baseline) and the pass's
    # entropy as the adapter keeps it for compute_advantage in the legacy trainer (empg)
    # and the teacher's log-probs as verl's teacher loop writes them (on_policy_distillation)
    fields = {"old_log_prob": "old_log_probs", "sum_pi_squared": "sum_pi_squared", "entropy": KEPT_ENTROPY,
              "teacher_log_prob": "teacher_logprobs"}
    old_pass = {fields[k]: v for k, v in M.advantage_inputs(name, b).items()}
    data = DataProto.from_dict(
        tensors={"token_level_rewards": b["token_level_rewards"], "response_mask": b["response_mask"], **old_pass},
        non_tensors={"uid": np.array([f"g{int(i)}" for i in b["index"]], dtype=object)},
    )
    verl_name = M.selection_name(FRAMEWORK, stablerl.get_spec(M.ADVANTAGE_ESTIMATOR, name))
    out = compute_advantage(data, verl_name, gamma=1.0, lam=1.0, norm_adv_by_std_in_grpo=norm, config=algorithm)
    return out.batch["advantages"] * b["response_mask"]


@pytest.mark.parametrize("kind, name", ALGORITHMS, ids=[f"{k}:{n}" for k, n in ALGORITHMS])
def test_parity_matrix(adapter, results, kind, name):
    M.check_case(results, kind, name, lambda *a: _through_ppo_loss(adapter, *a), _through_compute_advantage)
