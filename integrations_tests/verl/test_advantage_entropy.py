"""The old-log-prob pass's entropy at verl's advantage step (legacy ``RayPPOTrainer``, ``trainer.use_v1=false``).

verl's own ``RayPPOTrainer._compute_old_log_prob`` runs here on a legacy-layout batch (a stand-in worker group
answers ``compute_log_prob`` as verl's engine worker does: no-padding entropies over prompt + response); then the
trainer's own steps follow (``old_log_prob.batch.pop("entropys")``, ``batch.union``, ``compute_advantage``). The
entropy the filter sees must be the pass's, response-aligned exactly as verl slices its ``entropys``. The whole
trainer runs it in ``test_main_ppo_e2e.py::test_a3po_d3s_*``.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from omegaconf import OmegaConf, open_dict

import stablerl
from stablerl.frameworks import apply_filter_result

P = [3, 2, 4, 1]  # prompt lengths
R = [4, 2, 5, 3]  # response lengths
UIDS = np.array(["a", "a", "b", "b"], dtype=object)


def _legacy_batch():
    """A DataProto in the legacy trainer's layout: left-padded prompts, right-padded responses."""
    from verl import DataProto

    B, TP, TR = len(P), max(P), max(R)
    prompts = torch.zeros(B, TP, dtype=torch.long)
    responses = torch.zeros(B, TR, dtype=torch.long)
    attention = torch.zeros(B, TP + TR, dtype=torch.long)
    full = []  # each row's valid ids, prompt then response
    next_id = 1
    for i, (p, r) in enumerate(zip(P, R)):
        ids = torch.arange(next_id, next_id + p + r)
        next_id += p + r
        prompts[i, TP - p:] = ids[:p]
        responses[i, :r] = ids[p:]
        attention[i, TP - p:TP + r] = 1
        full.append(ids)
    response_mask = attention[:, TP:].clone()
    position_ids = (attention.cumsum(-1) - 1).clamp(min=0)
    scores = torch.tensor([1.0, 0.0, 1.0, 1.0])
    rewards = torch.zeros(B, TR)
    rewards[torch.arange(B), torch.tensor(R) - 1] = scores
    batch = DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], -1),
                 "attention_mask": attention, "position_ids": position_ids, "response_mask": response_mask.float(),
                 "token_level_scores": rewards, "token_level_rewards": rewards},
        non_tensors={"uid": UIDS},
    )
    # the model output at sequence position p-1+t predicts response token t: the entropy verl keeps for token t
    expected = torch.zeros(B, TR)
    for i, (p, r) in enumerate(zip(P, R)):
        expected[i, :r] = _entropy_of(full[i][p - 1:p + r - 1])
    return batch, expected


def _entropy_of(ids):
    return 0.05 * ids.double() + 0.1  # a per-position value the stand-in computes from the token id


class _WorkerGroup:
    """Answers ``compute_log_prob`` as verl's engine worker: no-padding tensors over prompt + response."""

    def __init__(self):
        self.calls = []

    def compute_log_prob(self, batch_td):
        from verl.utils import tensordict_utils as tu

        self.calls.append(dict(calculate_entropy=tu.get(batch_td, "calculate_entropy")))
        ids = batch_td["input_ids"]  # nested, jagged over each row's valid tokens
        values = ids.values()
        entropy = torch.nested.nested_tensor_from_jagged(_entropy_of(values).float(), offsets=ids.offsets())
        log_probs = torch.nested.nested_tensor_from_jagged(-0.1 * values.float(), offsets=ids.offsets())
        return tu.get_tensordict({"entropy": entropy, "log_probs": log_probs}, non_tensor_dict={"metrics": {"mfu": 0.0}})


def _algorithm(**extra):
    conf = OmegaConf.create({"_target_": "verl.trainer.config.AlgoConfig", "gamma": 1.0, "lam": 1.0,
                             "adv_estimator": "grpo", "norm_adv_by_std_in_grpo": True, "use_kl_in_reward": False})
    OmegaConf.set_struct(conf, True)
    with open_dict(conf):
        for k, v in extra.items():
            conf[k] = v
    return conf


def _trainer(algorithm, total_steps=4):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    trainer = RayPPOTrainer.__new__(RayPPOTrainer)  # the methods under test read only these attributes
    trainer.config = OmegaConf.create({"actor_rollout_ref": {"actor": {"calculate_sum_pi_squared": False}}})
    with open_dict(trainer.config):
        trainer.config.algorithm = algorithm
    trainer.actor_rollout_wg = _WorkerGroup()
    trainer.total_training_steps = total_steps
    return trainer


def _fit_step(trainer, batch):
    """What RayPPOTrainer.fit does from the old-log-prob pass to compute_advantage (verl 0.9.1, not bypass mode)."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    old_log_prob, _ = trainer._compute_old_log_prob(batch)
    old_log_prob.batch.pop("entropys")  # as fit() does, after logging actor/entropy
    batch = batch.union(old_log_prob)
    return compute_advantage(batch, adv_estimator=trainer.config.algorithm.adv_estimator, num_repeat=2,
                             config=trainer.config.algorithm)


@pytest.fixture
def site(adapter):
    from stablerl.adapters.verl import _advantage

    _advantage.reset_state()
    yield _advantage
    _advantage.reset_state()
    _advantage.verl_adapter().state.total_steps = None


def test_the_old_log_prob_pass_is_wrapped(adapter, site):
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer

    assert getattr(RayPPOTrainer._compute_old_log_prob, "__stablerl_verl_patch__", False)
    assert "compute_advantage:_compute_old_log_prob" in adapter.ADAPTER.ledger.keys()


def test_gtpo_entropy_filter_sees_the_old_pass_entropy(adapter, site):
    params = {"ent_threshold": 0.9, "ent_scale": 0.1}
    trainer = _trainer(_algorithm(stablerl_batch_filter="gtpo_entropy_filter", stablerl_batch_filter_params=params))
    batch, expected = _legacy_batch()
    mask = batch.batch["response_mask"].clone()
    out = _fit_step(trainer, batch)
    assert site.KEPT_ENTROPY not in out.batch.keys() and "entropys" not in out.batch.keys()  # verl's own update batch
    grpo, _ = stablerl.compute_advantage("grpo", token_level_rewards=batch.batch["token_level_rewards"],
                                         response_mask=mask, index=UIDS)
    ref = stablerl.filter_batch("gtpo_entropy_filter", advantages=grpo, response_mask=mask, index=UIDS,
                                entropy=expected, **params)
    torch.testing.assert_close(out.batch["advantages"], ref.advantages.float(), rtol=0, atol=1e-6)
    h = [float(expected[i, :r].mean()) for i, r in enumerate(R)]
    assert min(h) < 0.9 < max(h)  # the threshold drops some completions and penalises the others
    assert site.verl_adapter().state.metrics["stablerl/gtpo_filter/dropped_frac"] == pytest.approx(sum(x > 0.9 for x in h) / len(R))
    assert site.verl_adapter().state.metrics["stablerl/gtpo_filter/entropy_mean"] == pytest.approx(sum(h) / len(h), rel=1e-6)


def test_d3s_schedule_runs_on_the_trainers_total_steps(adapter, site):
    params = {"n_init": 0.5, "n_final": 1.0, "k_init": 0.5, "k_final": 1.0}
    trainer = _trainer(_algorithm(stablerl_batch_filter="d3s", stablerl_batch_filter_params=params), total_steps=4)
    progress = []
    for _ in range(2):
        batch, expected = _legacy_batch()
        mask = batch.batch["response_mask"].clone()
        step = site.verl_adapter().state.driver.step
        out = _fit_step(trainer, batch)
        progress.append(site.verl_adapter().state.metrics["stablerl/d3s/progress"])
        grpo, _ = stablerl.compute_advantage("grpo", token_level_rewards=batch.batch["token_level_rewards"],
                                             response_mask=mask, index=UIDS)
        result = stablerl.filter_batch("d3s", advantages=grpo, response_mask=mask, index=UIDS, entropy=expected,
                                       ctx=stablerl.Context(step=step, total_steps=4), **params)
        ref = apply_filter_result(result, mask, grpo, selected_by="d3s", why_no_resampling="")
        torch.testing.assert_close(out.batch["response_mask"], ref.response_mask.float(), rtol=0, atol=0)
        torch.testing.assert_close(out.batch["advantages"], ref.advantages.float(), rtol=0, atol=1e-6)
    assert progress == [0.0, 0.25]  # compute_advantage calls so far / total_training_steps
    assert 0 < site.verl_adapter().state.metrics["stablerl/d3s/kept_token_frac"] < 1


def test_the_entropy_is_kept_only_for_an_algorithm_that_declares_it(adapter, site):
    trainer = _trainer(_algorithm(stablerl_batch_filter="dynamic_sampling"))
    batch, _ = _legacy_batch()
    old_log_prob, _ = trainer._compute_old_log_prob(batch)
    assert site.KEPT_ENTROPY not in old_log_prob.batch.keys()
    trainer = _trainer(_algorithm(stablerl_batch_filter="d3s"))
    old_log_prob, _ = trainer._compute_old_log_prob(batch)
    torch.testing.assert_close(old_log_prob.batch[site.KEPT_ENTROPY], old_log_prob.batch["entropys"], rtol=0, atol=0)
    assert site.needs_entropy(_algorithm(stablerl_batch_filter="gtpo_entropy_filter"))
    assert site.needs_entropy(_algorithm(adv_estimator="empg"))  # an estimator that declares it, too
    assert not site.needs_entropy(_algorithm(adv_estimator="qae"))


def test_without_the_old_pass_the_error_names_the_setting(adapter, site):
    """Bypass mode (or the v1 trainer) gives compute_advantage no entropy: the error says where it comes from."""
    from verl.trainer.ppo.ray_trainer import compute_advantage

    batch, _ = _legacy_batch()
    with pytest.raises(stablerl.StableRLError, match=r"gtpo_entropy_filter.*entropy.*legacy trainer's old-log-prob pass"):
        compute_advantage(batch, adv_estimator="grpo", num_repeat=2,
                          config=_algorithm(stablerl_batch_filter="gtpo_entropy_filter"))
    with pytest.raises(stablerl.MissingInputError, match=r"estimator 'empg' needs 'entropy'.*legacy trainer's "
                       r"old-log-prob pass.*set trainer\.use_v1=false and leave bypass mode off"):
        compute_advantage(batch, adv_estimator="empg", num_repeat=2, config=_algorithm(adv_estimator="empg"))


def test_empg_gets_the_old_pass_entropy_without_an_opt_in(adapter, site):
    """algorithm.adv_estimator=empg alone (no +algorithm.stablerl_batch_field_estimators): its advantages equal
    stablerl.compute_advantage on the pass's entropies, response-aligned by hand. A masked token (a tool
    response in a multi-turn row) splits that response into two steps: empg's steps are the mask's runs."""
    from stablerl.ops import mask_runs

    trainer = _trainer(_algorithm(adv_estimator="empg", k=2.0, zeta=0.5))
    batch, expected = _legacy_batch()
    batch.batch["response_mask"][2, 2] = 0  # row 2 (5 response tokens): steps [0, 1] and [3, 4]
    mask = batch.batch["response_mask"].clone()
    assert int(mask_runs(mask)[2].max()) == 1
    out = _fit_step(trainer, batch)
    assert site.KEPT_ENTROPY not in out.batch.keys() and "entropys" not in out.batch.keys()  # verl's own update batch
    rewards = batch.batch["token_level_rewards"]
    ref, ref_returns = stablerl.compute_advantage("empg", token_level_rewards=rewards, response_mask=mask,
                                                  index=UIDS, entropy=expected, k=2.0, zeta=0.5)
    torch.testing.assert_close(out.batch["advantages"], ref.float(), rtol=0, atol=1e-6)
    torch.testing.assert_close(out.batch["returns"], ref_returns.float(), rtol=0, atol=1e-6)
    # the entropy matters: a flat one (every step equally certain) gives other advantages
    flat, _ = stablerl.compute_advantage("empg", token_level_rewards=rewards, response_mask=mask, index=UIDS,
                                         entropy=torch.ones_like(expected), k=2.0, zeta=0.5)
    assert (ref - flat).abs().max() > 0.05
    # row 2's first step gets the bonus zeta * f of its next step: its two steps' advantages differ
    assert abs(float(out.batch["advantages"][2, 0] - out.batch["advantages"][2, 3])) > 0.05
