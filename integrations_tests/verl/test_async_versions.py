"""Policy versions under verl's asynchronous trainers (``verl.experimental``: one-step-off, fully async).

verl labels each trajectory with the weight sync that generated it (``min_global_steps`` / ``max_global_steps``,
from ``CheckpointEngineManager.update_weights(global_steps)``); the adapter counts the actor updates each sync
carried and stamps every row with its version and the batch with the version its update produces
(``adapters/verl/_versions.py``). Here: verl's own ``OneStepOffRayTrainer`` (its inherited
``RayPPOTrainer._update_actor``, wrapped) and ``CheckpointEngineManager.update_weights`` (wrapped; its naive backend
with a worker group that answers at once) in the order ``OneStepOffRayTrainer.fit`` calls them, then verl's real
``ppo_loss`` on a micro-batch carrying those stamps, checked against A-3PO's formula computed here by hand.
The whole trainer on CPU: ``test_main_ppo_e2e.py::test_a3po_one_step_off_alpha_is_one_half``."""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest
import torch

import stablerl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from test_declared_inputs import CLIP, R, _batch, _config, _direct, _legacy_trainer, _through_verl  # noqa: E402

LABELS_MIXED = [1, 2, 1, 2, 2, 1]  # a batch of two syncs (the fully-async trainer's queue mixes them)
P_ = [3, 2, 4, 1, 2, 3]


def _legacy(labels, lo=None):
    """A DataProto as verl's agent loop hands it to the trainer: left-padded prompts, right-padded responses, and
    each trajectory's weight labels."""
    from verl import DataProto

    B, TP, TR = len(P_), max(P_), max(R)
    prompts = torch.zeros(B, TP, dtype=torch.long)
    responses = torch.zeros(B, TR, dtype=torch.long)
    attention = torch.zeros(B, TP + TR, dtype=torch.long)
    for i, (p, r) in enumerate(zip(P_, R)):
        prompts[i, TP - p:] = torch.arange(1, p + 1)
        responses[i, :r] = torch.arange(1, r + 1)
        attention[i, TP - p:TP + r] = 1
    return DataProto.from_dict(
        tensors={"prompts": prompts, "responses": responses, "input_ids": torch.cat([prompts, responses], -1),
                 "attention_mask": attention, "position_ids": (attention.cumsum(-1) - 1).clamp(min=0),
                 "response_mask": attention[:, TP:].float()},
        non_tensors={"uid": np.array(list("abcabc"), dtype=object),
                     "min_global_steps": np.array(lo if lo is not None else labels, dtype=object),
                     "max_global_steps": np.array(labels, dtype=object)},
    )


@pytest.fixture
def one_step_off(adapter, monkeypatch):
    """verl's OneStepOffRayTrainer (only the attributes _update_actor reads) with a real CheckpointEngineManager."""
    from verl.checkpoint_engine import base
    from verl.experimental.one_step_off_policy.ray_trainer import OneStepOffRayTrainer

    assert getattr(base.CheckpointEngineManager.update_weights, "__stablerl_verl_patch__", False)
    manager = base.CheckpointEngineManager.__new__(base.CheckpointEngineManager)
    manager.backend, manager.replicas = "naive", []  # naive: the actor group's update_weights only
    manager.actor_wg = types.SimpleNamespace(update_weights=lambda global_steps=None, mode=None: [])
    monkeypatch.setattr(base.ray, "get", lambda refs: refs)  # no Ray here: the stand-in group answers at once
    trainer = _legacy_trainer(OneStepOffRayTrainer, global_steps=0)
    trainer.checkpoint_manager = manager
    return trainer


def _stamps(batch_td):
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._versions import ERROR_KEY, POLICY_VERSION_KEY, VERSION_FIELD

    rows = tu.get(batch_td, VERSION_FIELD, None)
    return ([int(v) for v in rows] if rows is not None else None,
            tu.get_non_tensor_data(batch_td, POLICY_VERSION_KEY, None), tu.get_non_tensor_data(batch_td, ERROR_KEY, None))


def _run_steps(trainer, batches):
    """``OneStepOffRayTrainer.fit``'s order: a sync labelled 0 before the first step; step k takes its batch
    (generated before this step's sync), syncs with label k, then updates the actor."""
    trainer.checkpoint_manager.update_weights(0)
    for step, batch in enumerate(batches, start=1):
        trainer.global_steps = step
        trainer.checkpoint_manager.update_weights(step)
        trainer._update_actor(batch)
    return [_stamps(b) for b in trainer.actor_rollout_wg.batches]


def test_one_step_off_rows_get_the_updates_of_their_sync(one_step_off):
    """Labels 0 and 1 are both the initial weights (the sync before step 1 and the one at step 1, before any
    update), label 2 the weights after one update; the update of step k produces version k."""
    got = _run_steps(one_step_off, [_legacy([0] * 6), _legacy([1] * 6), _legacy(LABELS_MIXED)])
    assert got == [([0] * 6, 1, None), ([0] * 6, 2, None), ([0, 1, 0, 1, 1, 0], 3, None)]
    # the legacy trainer's one-version mark is not written for these batches
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._inputs import VERSION_KEY

    assert all(tu.get_non_tensor_data(b, VERSION_KEY, None) is None for b in one_step_off.actor_rollout_wg.batches)


def test_the_sync_wrap_keeps_verls_auto_await(one_step_off):
    """verl's update_weights is an ``auto_await`` coroutine: the fully-async trainer awaits it inside its event loop
    (it must get the coroutine), the one-step-off trainer calls it from a plain method (it must run). Both count."""
    import asyncio

    manager = one_step_off.checkpoint_manager

    async def fully_async_style():
        return await manager.update_weights(global_steps=5)

    def plain(label):
        return manager.update_weights(label)

    async def one_step_off_style():  # a plain method called inside the trainer's event loop
        return plain(6)

    assert asyncio.run(fully_async_style()) == {} and asyncio.run(one_step_off_style()) == {} and plain(7) == {}
    from stablerl.adapters.verl._versions import _SYNCS

    assert manager.__dict__[_SYNCS] == {5: 0, 6: 0, 7: 0}


def test_rows_without_one_known_version_get_a_reason(one_step_off):
    partial = _legacy([2, 2, 2, 2, 2, 2], lo=[2, 2, 1, 2, 2, 2])  # row 2: a partial rollout over syncs 1..2
    unknown = _legacy([7] * 6)
    got = _run_steps(one_step_off, [_legacy([0] * 6), partial, unknown])
    assert got[1][0] is None and got[1][1] == 2 and "row 2" in got[1][2] and "partial rollout" in got[1][2]
    assert got[2][0] is None and "sync 7" in got[2][2] and "never sent" in got[2][2]


def _a3po_by_hand(padded, versions_row, policy_version):
    """A-3PO (arXiv 2512.06547) on the padded tensors, written out here: alpha per row, the log-linear proximal
    log-prob, the behaviour weight (mask band [0, 5]), the dual-clipped PPO term, token-mean over verl's global
    token count."""
    v = torch.tensor(versions_row, dtype=torch.float64).unsqueeze(1)
    alpha = torch.where(policy_version - v > 0, (policy_version - 1 - v) / (policy_version - v), torch.zeros_like(v))
    lp, lp_b, adv = padded["log_prob"], padded["rollout_log_prob"], padded["advantages"]
    mask = padded["response_mask"].to(torch.float64)
    lp_prox = lp_b + alpha * (lp.detach() - lp_b)
    w = torch.exp(lp_prox - lp_b)
    keep = (w <= 5.0).to(torch.float64)
    ratio = torch.exp(lp - lp_prox)
    pg = torch.maximum(-adv * ratio, -adv * ratio.clamp(1 - CLIP["clip_ratio_low"], 1 + CLIP["clip_ratio_high"]))
    pg = torch.where(adv < 0, torch.minimum(pg, -adv * CLIP["clip_ratio_c"]), pg)
    loss = (pg * (w * keep).detach() * mask).sum() / (sum(R) + 4)  # _batch: batch_num_tokens = sum(R) + 4, dp 1
    alpha_mean = float((alpha.expand_as(mask) * mask).sum() / mask.sum())
    return loss, alpha_mean


def _stamped(data, rows, policy_version):
    """The micro-batch a worker hands to ppo_loss, with the stamps the trainer's batch carried (verl splits
    per-row non-tensor fields with the rows and copies the meta info to every micro-batch)."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._versions import POLICY_VERSION_KEY, VERSION_FIELD

    data[VERSION_FIELD] = NonTensorStack.from_list([NonTensorData(int(v)) for v in rows])
    tu.assign_non_tensor(data, **{POLICY_VERSION_KEY: policy_version})
    return data


def test_a3po_on_a_batch_of_two_versions_matches_the_formula(adapter, one_step_off):
    """Step 3's batch mixes versions 0 and 1 (policy version 3): alpha 2/3 on the rows two versions old, 1/2 on
    those one version old; verl's ppo_loss gives A-3PO's loss, written out by hand, and stablerl's direct call."""
    got = _run_steps(one_step_off, [_legacy([0] * 6), _legacy([1] * 6), _legacy(LABELS_MIXED)])
    rows, policy_version, _ = got[2]
    data, model_output, leaves, padded = _batch(seed=21)
    loss, grad, metrics = _through_verl(_config(adapter, "a3po"), _stamped(data, rows, policy_version),
                                        model_output, leaves)
    by_hand, alpha_mean = _a3po_by_hand(padded, rows, policy_version)
    torch.testing.assert_close(loss, by_hand.detach(), rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, torch.cat(torch.autograd.grad(by_hand, leaves)), rtol=1e-9, atol=1e-12)
    lengths = torch.tensor(R, dtype=torch.float64)
    expected_alpha = float(sum(n * (2 / 3 if v == 0 else 1 / 2) for n, v in zip(R, rows)) / lengths.sum())
    assert metrics["actor/a3po/alpha_mean"] == pytest.approx(expected_alpha, rel=1e-6)  # verl logs float32
    assert alpha_mean == pytest.approx(expected_alpha, rel=1e-12)
    versions = torch.where(padded["response_mask"], torch.tensor(rows).unsqueeze(1), torch.tensor(-1))
    ref_loss, ref_grad, _ = _direct("a3po", {**padded, "versions": versions, "policy_version": policy_version},
                                    leaves, ("rollout_log_prob", "versions", "policy_version"), **CLIP)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    # the versions matter: the same batch as one version (the legacy trainer's) is plain PPO on the rollout log-probs
    one = _through_verl(_config(adapter, "a3po"), _stamped(_batch(seed=21)[0], [2] * 6, 3), model_output, leaves)
    assert one[2]["actor/a3po/alpha_mean"] == 0.0 and abs(float(one[0]) - float(loss)) > 1e-4


def test_a3po_refuses_a_batch_stamped_with_a_reason(adapter, one_step_off):
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._versions import ERROR_KEY

    partial = _legacy([2] * 6, lo=[2, 2, 1, 2, 2, 2])
    reason = _run_steps(one_step_off, [_legacy([0] * 6), partial])[1][2]
    data, model_output, leaves, _ = _batch(seed=22)
    tu.assign_non_tensor(data, **{ERROR_KEY: reason})
    with pytest.raises(stablerl.StableRLError, match=r"a3po.*asynchronous trainer.*row 2.*partial rollout"):
        _through_verl(_config(adapter, "a3po"), data, model_output, leaves)
    # a loss that reads no versions is not affected by the reason
    data, model_output, leaves, _ = _batch(seed=22)
    tu.assign_non_tensor(data, **{ERROR_KEY: reason})
    _through_verl(_config(adapter, "vanilla"), data, model_output, leaves)



def test_row_versions_name_the_first_row_without_one_version():
    """Labels drawn at random: every row gets its sync's updates, or the reason names the first row that has no
    single known version (labels that differ, a missing label, a label never sent)."""
    hypothesis = pytest.importorskip("hypothesis")
    from hypothesis import strategies as st

    from stablerl.adapters.verl._versions import row_versions

    syncs = {0: 0, 1: 0, 2: 1, 3: 2}
    label = st.one_of(st.none(), st.integers(0, 5))

    @hypothesis.settings(max_examples=200, deadline=None)
    @hypothesis.given(st.lists(st.tuples(label, label), min_size=1, max_size=8))
    def check(pairs):
        lo, hi = [a for a, _ in pairs], [b for _, b in pairs]
        rows, error = row_versions({"min_global_steps": np.array(lo, dtype=object),
                                    "max_global_steps": np.array(hi, dtype=object)}, syncs)
        bad = [i for i, (a, b) in enumerate(pairs) if a is None or b is None or a != b or a not in syncs]
        if not bad:
            assert error is None and rows == [syncs[a] for a in lo]
        else:
            assert rows is None and error.startswith(f"row {bad[0]} ")

    check()
    assert row_versions({"min_global_steps": np.array([1], dtype=object)}, syncs)[1].startswith("the batch has no")
