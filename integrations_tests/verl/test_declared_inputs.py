"""Declared loss inputs under verl: the adapter wraps verl's loss call site
``verl.workers.utils.losses.ppo_loss`` and hands each stablerl loss exactly the inputs it declares
(entropy, token ids, uids, scores, rollout log-probs, old entropy), gathered from verl's own
``model_output`` and batch. Every test goes through verl's real ``ppo_loss`` and compares with
``stablerl.compute_policy_loss`` called directly on padded tensors built here by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import stablerl

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # the sibling test modules' batch builders

P = [3, 2, 4, 1, 2, 3]  # prompt lengths
R = [4, 3, 5, 2, 5, 1]  # response lengths
UIDS = ["a", "b", "a", "b", "a", "b"]  # two interleaved groups of 3
T = max(R)


def _nt(xs):
    return torch.nested.as_nested_tensor(xs, layout=torch.jagged)


def _batch(seed=0, *, entropy=True, uid=True, old_entropy=False, labels=False, uids=UIDS):
    """What an engine worker hands to ppo_loss (jagged tensors, uid as a NonTensorStack as
    ``DataProto.to_tensordict`` makes it), the model output, and the hand-padded [B, T] tensors
    the loss must see."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    g = torch.Generator().manual_seed(seed)
    B = len(R)
    vocab = 3  # few token ids: responses of a group share prefixes (GTPO conflicts)
    responses = [torch.randint(0, vocab, (n,), generator=g) for n in R]
    old = [torch.randn(n, generator=g, dtype=torch.float64) * 0.3 - 0.4 for n in R]
    rollout = [o + 0.1 * torch.randn(n, generator=g, dtype=torch.float64) for o, n in zip(old, R)]
    adv = [1.0, -0.5, -0.7, 1.2, 0.4, -0.9]
    score = [1.0, 0.0, 0.0, 1.0, 1.0, 0.0] if labels else [0.8, -0.3, 0.1, 1.1, 0.6, -0.2]
    token_scores = [F.pad(torch.zeros(n - 1, dtype=torch.float64), (0, 1), value=s) for n, s in zip(R, score)]
    old_ent = [torch.rand(n, generator=g, dtype=torch.float64) * 1.5 for n in R]
    fields = {
        "prompts": _nt([torch.arange(n) + 1 for n in P]),
        "responses": _nt(responses),
        "response_mask": _nt([torch.ones(n) for n in R]),
        "old_log_probs": _nt(old),
        "advantages": _nt([torch.full((n,), a, dtype=torch.float64) for n, a in zip(R, adv)]),
        "rollout_log_probs": _nt(rollout),
        "token_level_scores": _nt(token_scores),
    }
    if old_entropy:
        fields["entropy"] = _nt(old_ent)  # the v1 trainer's old-log-prob-pass entropy
    data = TensorDict(fields, batch_size=[B])
    if uid:
        data["uid"] = NonTensorStack.from_list([NonTensorData(u) for u in uids])
    tu.assign_non_tensor(data, dp_size=1, batch_num_tokens=sum(R) + 4, global_batch_size=B + 2)
    # model output over prompt + response; position p-1+t predicts response token t
    leaves = [(torch.randn(p + r, generator=g, dtype=torch.float64) * 0.3 - 0.5).requires_grad_(True) for p, r in zip(P, R)]
    ent = [torch.rand(p + r, generator=g, dtype=torch.float64) * 1.2 for p, r in zip(P, R)]
    model_output = {"log_probs": _nt(leaves)}
    if entropy:
        model_output["entropy"] = _nt(ent)

    def pad(rows, dtype=None):
        return torch.stack([F.pad(x, (0, T - x.shape[0])) for x in rows]).to(dtype or rows[0].dtype)

    padded = {
        "log_prob": pad([leaf[p - 1 : p + r - 1] for leaf, p, r in zip(leaves, P, R)]),
        "entropy": pad([e[p - 1 : p + r - 1] for e, p, r in zip(ent, P, R)]),
        "old_log_prob": pad(old),
        "advantages": pad([torch.full((n,), a, dtype=torch.float64) for n, a in zip(R, adv)]),
        "response_mask": pad([torch.ones(n, dtype=torch.bool) for n in R]),
        "rollout_log_prob": pad(rollout),
        "token_ids": pad(responses),
        "index": np.array(UIDS, dtype=object),
        "scores": torch.tensor(score, dtype=torch.float64),
        "old_entropy": pad(old_ent),
    }
    return data, model_output, leaves, padded


def _config(adapter, loss_mode, **kw):
    from verl.workers.config import FSDPActorConfig

    kw.setdefault("clip_ratio_low", 0.2)
    kw.setdefault("clip_ratio_high", 0.28)
    kw.setdefault("clip_ratio_c", 10.0)
    kw.setdefault("rollout_n", 3)  # the batch's groups of 3 (a loss that takes groups checks each is whole)
    return FSDPActorConfig(
        strategy="fsdp", ppo_micro_batch_size_per_gpu=3, calculate_entropy=True,
        policy_loss=adapter.StablePolicyLossConfig(loss_mode=loss_mode), **kw,
    )


def _through_verl(cfg, data, model_output, leaves):
    from verl.workers.utils.losses import ppo_loss

    loss, metrics = ppo_loss(cfg, model_output, data)
    grads = torch.autograd.grad(loss, leaves)
    values = {k: float(v.aggregate()) if hasattr(v, "aggregate") else float(v) for k, v in metrics.items()}
    return loss.detach(), torch.cat(grads), values


def _direct(name, padded, leaves, inputs, state=None, **params):
    ctx = stablerl.Context(token_count=sum(R) + 4, seq_count=len(R) + 2, dp_size=1, state=state if state is not None else {})
    extra = {k: padded[k] for k in inputs if k != "entropy"}
    loss, metrics = stablerl.compute_policy_loss(
        name,
        log_prob=padded["log_prob"],
        old_log_prob=padded["old_log_prob"],
        advantages=padded["advantages"],
        response_mask=padded["response_mask"],
        entropy=padded["entropy"] if "entropy" in inputs else None,
        ctx=ctx,
        **extra,
        **params,
    )
    grads = torch.autograd.grad(loss, leaves, allow_unused=True)
    grads = [torch.zeros_like(leaf) if gr is None else gr for gr, leaf in zip(grads, leaves)]
    return loss.detach(), torch.cat(grads), metrics


@pytest.fixture
def declared(adapter):
    from stablerl.adapters.verl import _inputs

    _inputs.instrument()
    _inputs.verl_adapter().state.loss.clear()
    yield _inputs
    _inputs.instrument()
    _inputs.verl_adapter().state.loss.clear()


CLIP = dict(clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0)

CASES = [
    # name, its declared inputs, the hyper-parameters the actor config gives it, batch options
    ("steer", ("entropy",), CLIP, {}),
    ("gtpo", ("token_ids", "index", "entropy"), {}, {}),
    ("entropic", ("entropy",), CLIP, {}),
    ("erc", ("entropy", "old_entropy"), CLIP, {"old_entropy": True}),
    ("decoupled_ppo", ("rollout_log_prob",), CLIP, {}),
    ("pacs", ("scores", "index"), {}, {"labels": True}),
    ("gvpo", ("scores", "index"), {}, {}),
    ("rebel", ("scores", "index"), {}, {}),
]


@pytest.mark.parametrize("name, inputs, params, opts", CASES, ids=[c[0] for c in CASES])
def test_declared_inputs_reach_the_loss_through_ppo_loss(adapter, declared, name, inputs, params, opts):
    assert set(stablerl.get_spec("policy_loss", name).requires) == set(inputs)
    data, model_output, leaves, padded = _batch(seed=1, **opts)
    loss, grad, metrics = _through_verl(_config(adapter, name), data, model_output, leaves)
    ref_loss, ref_grad, ref_metrics = _direct(name, padded, leaves, inputs, **params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0 and torch.isfinite(loss)
    for k, v in ref_metrics.items():
        assert metrics[f"actor/{k}"] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    if name == "gtpo":  # the batch exercises both GTPO mechanisms
        assert metrics["actor/gtpo/conflict_tokens"] > 0
        assert 0 < metrics["actor/gtpo/entropy_filtered_fraction"] < 1
    assert declared.current() is None  # nothing leaks out of the call


def test_inputs_matter(adapter, declared):
    """The gathered inputs are the ones used: other entropies / token ids / uids change the result."""
    data, model_output, leaves, padded = _batch(seed=2)
    base = _through_verl(_config(adapter, "gtpo"), data, model_output, leaves)[0]
    for key, change in (
        ("entropy", lambda p: {**p, "entropy": p["entropy"] * 0.1}),
        ("token_ids", lambda p: {**p, "token_ids": torch.zeros_like(p["token_ids"])}),
        ("index", lambda p: {**p, "index": np.array(["a", "a", "a", "b", "b", "b"], dtype=object)}),
    ):
        other = _direct("gtpo", change(padded), leaves, ("token_ids", "index", "entropy"))[0]
        assert abs(float(other) - float(base)) > 1e-6, key


def test_steer_uses_the_current_entropy_from_model_output(adapter, declared):
    data, model_output, leaves, padded = _batch(seed=3)
    loss = _through_verl(_config(adapter, "steer"), data, model_output, leaves)[0]
    scaled = {**model_output, "entropy": model_output["entropy"] * 3.0}
    loss3 = _through_verl(_config(adapter, "steer"), data, scaled, leaves)[0]
    ref3 = _direct("steer", {**padded, "entropy": padded["entropy"] * 3.0}, leaves, ("entropy",), **CLIP)[0]
    assert abs(float(loss3) - float(loss)) > 1e-6
    torch.testing.assert_close(loss3, ref3, rtol=1e-9, atol=1e-12)


def test_steer_reads_the_old_pass_entropy_when_verl_has_it(adapter, declared):
    """steer's optional input: with the old-log-prob pass's entropy in the batch (verl's v1 trainer) steer
    weights by it, as the reference does; without it (the test above) it falls back to the current entropy."""
    assert stablerl.get_spec("policy_loss", "steer").optional_inputs == ("old_entropy",)
    data, model_output, leaves, padded = _batch(seed=5, old_entropy=True)
    loss = _through_verl(_config(adapter, "steer"), data, model_output, leaves)[0]
    with_old = _direct("steer", padded, leaves, ("entropy", "old_entropy"), **CLIP)[0]
    current_only = _direct("steer", padded, leaves, ("entropy",), **CLIP)[0]
    torch.testing.assert_close(loss, with_old, rtol=1e-9, atol=1e-12)
    assert abs(float(with_old) - float(current_only)) > 1e-6


def test_verl_wrapper_logic_still_runs(adapter, declared):
    """entropy bonus and KL loss are added by verl's own ppo_loss around the stablerl loss."""
    data, model_output, leaves, padded = _batch(seed=4)
    data["ref_log_prob"] = data["old_log_probs"].clone()
    cfg = _config(adapter, "steer", entropy_coeff=0.01, use_kl_loss=True, kl_loss_coef=0.1, kl_loss_type="k1")
    loss, _, metrics = _through_verl(cfg, data, model_output, leaves)
    assert {"actor/entropy_loss", "kl_loss", "actor/pg_loss"} <= set(metrics)
    expected = metrics["actor/pg_loss"] - 0.01 * metrics["actor/entropy_loss"] + 0.1 * metrics["kl_loss"]
    assert float(loss) == pytest.approx(expected, rel=1e-9)
    ref_pg = _direct("steer", padded, leaves, ("entropy",), **CLIP)[0]
    assert metrics["actor/pg_loss"] == pytest.approx(float(ref_pg), rel=1e-9)


def test_entropic_integral_accumulates_across_calls(adapter, declared):
    data, model_output, leaves, padded = _batch(seed=5)
    cfg = _config(adapter, "entropic")
    state: dict = {}
    integrals = []
    for _ in range(2):
        loss, grad, metrics = _through_verl(cfg, data, model_output, leaves)
        ref_loss, ref_grad, ref_metrics = _direct("entropic", padded, leaves, ("entropy",), state=state, **CLIP)
        torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
        integrals.append(metrics["actor/entropic/integral"])
    # the error of each call, weighted by sequences-in-call / sequences-in-mini-batch, is added up
    m = padded["response_mask"].double()
    error = float((padded["entropy"] * m).sum() / m.sum()) - 0.1
    step = error * len(R) / (len(R) + 2)
    assert integrals[0] == pytest.approx(step, rel=1e-6)
    assert integrals[1] == pytest.approx(2 * step, rel=1e-6)
    assert declared.state_for("entropic")["entropic"]["integral"] == pytest.approx(2 * step, rel=1e-6)
    assert declared.state_for("entropic")["entropic"]["updates"] == 2


def test_missing_entropy_names_the_key(adapter, declared):
    data, model_output, leaves, _ = _batch(seed=6, entropy=False)
    with pytest.raises(stablerl.StableRLError, match=r"actor_rollout_ref\.actor\.calculate_entropy=True"):
        _through_verl(_config(adapter, "steer"), data, model_output, leaves)
    assert declared.current() is None


def test_missing_uid_and_old_entropy_are_clear(adapter, declared):
    data, model_output, leaves, _ = _batch(seed=6, uid=False)
    with pytest.raises(stablerl.StableRLError, match=r"gtpo.*index.*uid"):
        _through_verl(_config(adapter, "gtpo"), data, model_output, leaves)
    data, model_output, leaves, _ = _batch(seed=6)
    with pytest.raises(stablerl.StableRLError, match=r"old_entropy.*v1 trainer"):
        _through_verl(_config(adapter, "erc"), data, model_output, leaves)


def test_input_verl_cannot_provide_is_a_clear_error(adapter, declared, core_algos):
    """capo (hidden_states) is not registered, and the report says why; forced into verl's
    registry, the wrapper refuses it with the reason instead of a shape error deep inside."""
    assert "capo" not in core_algos.POLICY_LOSS_REGISTRY
    assert "stablerl_capo" not in core_algos.POLICY_LOSS_REGISTRY
    reasons = {s["name"]: s["reason"] for s in adapter.registration_report()["skipped"] if s["kind"] == "policy_loss"}
    assert "hidden_states" in reasons["capo"] and "cannot provide" in reasons["capo"]
    assert "turn_ppo" in core_algos.POLICY_LOSS_REGISTRY  # turn ids are optional: the loss mask's runs
    from stablerl.adapters.verl._translate import make_policy_loss_fn

    core_algos.register_policy_loss("_stablerl_test_capo")(make_policy_loss_fn("capo"))
    try:
        data, model_output, leaves, _ = _batch(seed=7)
        with pytest.raises(stablerl.StableRLError, match=r"hidden_states.*verl 0\.9\.1 cannot provide"):
            _through_verl(_config(adapter, "_stablerl_test_capo"), data, model_output, leaves)
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("_stablerl_test_capo", None)
    assert declared.current() is None


def test_loss_called_outside_ppo_loss_says_so(adapter, declared, core_algos):
    _, _, _, p = _batch(seed=8)
    fn = core_algos.get_policy_loss_fn("steer")
    with pytest.raises(stablerl.StableRLError, match=r"did not come through"):
        fn(old_log_prob=p["old_log_prob"], log_prob=p["log_prob"], advantages=p["advantages"],
           response_mask=p["response_mask"], config=_config(adapter, "steer"))


def test_verl_losses_untouched_and_no_inputs_for_them(adapter, declared):
    """Under a verl loss the wrapper gathers nothing and the result is verl's."""
    from verl.workers.utils import losses

    data, model_output, leaves, _ = _batch(seed=9)
    cfg = _config(adapter, "vanilla")
    wrapped = _through_verl(cfg, data, model_output, leaves)
    plain = losses.ppo_loss.__wrapped__(cfg, model_output, data)[0]
    torch.testing.assert_close(wrapped[0], plain.detach(), rtol=0, atol=0)


def test_unpatch_and_patch_are_reversible_and_idempotent(adapter, declared):
    import verl.trainer.distillation.losses as distill
    from verl.workers.utils import losses

    wrapper = losses.ppo_loss
    assert declared.is_patched() and wrapper.__wrapped__ is not wrapper
    original = wrapper.__wrapped__
    assert not getattr(original, "_stablerl_verl_wrapper", False) and original.__module__ == losses.__name__
    assert distill.ppo_loss is wrapper  # bound at import time: the post-import hook was first
    adapter.unpatch_ppo_loss()
    assert losses.ppo_loss is original and distill.ppo_loss is original and not declared.is_patched()
    data, model_output, leaves, _ = _batch(seed=10)
    with pytest.raises(stablerl.StableRLError, match=r"did not come through"):
        _through_verl(_config(adapter, "steer"), data, model_output, leaves)
    assert declared.instrument() == "patched" and declared.instrument() == "patched"
    assert losses.ppo_loss.__wrapped__ is original and distill.ppo_loss is losses.ppo_loss
    _through_verl(_config(adapter, "steer"), data, model_output, leaves)


def test_nested_calls_see_their_own_inputs(adapter, declared, core_algos):
    """A loss that itself runs ppo_loss (as distillation does) gets its inputs back afterwards."""
    from stablerl.adapters.verl._translate import make_policy_loss_fn
    from verl.workers.utils.losses import ppo_loss

    inner_data, inner_out, inner_leaves, _ = _batch(seed=11)
    gtpo = make_policy_loss_fn("gtpo")
    seen = {}

    def outer(**kw):
        seen["before"] = declared.current()["index"].tolist()
        ppo_loss(_config(adapter, "steer"), inner_out, inner_data)
        seen["after"] = declared.current()["index"].tolist()
        return gtpo(**kw)

    outer._stablerl_verl = ("policy_loss", "gtpo")
    core_algos.register_policy_loss("_stablerl_test_outer")(outer)
    try:
        data, model_output, leaves, _ = _batch(seed=12, uids=list("xxxyyy"))
        _through_verl(_config(adapter, "_stablerl_test_outer"), data, model_output, leaves)
    finally:
        core_algos.POLICY_LOSS_REGISTRY.pop("_stablerl_test_outer", None)
    assert seen["before"] == seen["after"] == list("xxxyyy")
    assert declared.current() is None


FRESH = """
import json, sys, verl
from verl.trainer.ppo.core_algos import POLICY_LOSS_REGISTRY
import verl.workers.utils.losses as losses
import verl.trainer.distillation.losses as distill
import stablerl.adapters.verl as a
try:
    import verl.workers.engine_workers as ew  # the worker's `partial(ppo_loss, ...)` uses this binding
    ew_bound = ew.ppo_loss is losses.ppo_loss
except ImportError:  # needs uvicorn
    ew_bound = None
r = a.registration_report()
print(json.dumps({"losses": sorted(POLICY_LOSS_REGISTRY), "patch": r["ppo_loss_patch"],
                  "wrapped": getattr(losses.ppo_loss, "_stablerl_verl_wrapper", False),
                  "distill_bound": distill.ppo_loss is losses.ppo_loss, "ew_bound": ew_bound,
                  "provided": sorted(r["declared_inputs"]["provided"])}))
"""


def test_fresh_process_registers_the_losses_with_declared_inputs():
    env = {k: v for k, v in os.environ.items() if not k.startswith("VERL_USE_EXTERNAL")}
    proc = subprocess.run([sys.executable, "-c", FRESH], capture_output=True, text=True, env=env, cwd="/", timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    have = set(stablerl.get_registry().names("policy_loss"))
    new = {"steer", "entropic", "gtpo", "erc", "decoupled_ppo", "pacs", "gvpo", "a3po"} & have
    assert new, "none of the input-needing losses exists in this checkout"
    for name in new:
        assert name in out["losses"] and "stablerl_" + name in out["losses"], name
    assert "turn_ppo" in out["losses"]  # turn ids optional: the loss mask's runs of trained tokens
    for name in ("capo", "rspo"):
        assert name not in out["losses"] and "stablerl_" + name not in out["losses"], name
    # deferred at `import verl` (the adapter imports nothing heavy), then in place before any caller binds it
    assert out["patch"] == "deferred" and out["wrapped"] and out["distill_bound"] and out["ew_bound"] in (True, None)
    from stablerl.frameworks import get_framework

    assert set(out["provided"]) == set(get_framework("verl").feedable["policy_loss"])


def _dense(batch_out, pad_id=7):
    """The same batch in the legacy trainer's layout (``DataProto.to_tensordict`` +
    ``left_right_2_no_padding``): dense left-padded prompts, dense right-padded response fields
    (padding token ids are ``pad_id``, not 0), an attention mask, ``max_response_len``."""
    from tensordict import TensorDict
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    data, model_output, leaves, padded = batch_out
    B, Pm = len(R), max(P)
    prompts = torch.zeros(B, Pm, dtype=torch.long)
    attention = torch.zeros(B, Pm + T, dtype=torch.long)
    for i, (p, r) in enumerate(zip(P, R)):
        prompts[i, Pm - p :] = torch.arange(p) + 1
        attention[i, Pm - p : Pm + r] = 1
    mask = padded["response_mask"]
    scores = torch.zeros(B, T, dtype=torch.float64)
    scores[torch.arange(B), torch.tensor(R) - 1] = padded["scores"]
    dense = TensorDict(
        {
            "prompts": prompts,
            "responses": torch.where(mask, padded["token_ids"], torch.full_like(padded["token_ids"], pad_id)),
            "attention_mask": attention,
            "response_mask": mask.long(),
            "old_log_probs": padded["old_log_prob"],
            "advantages": padded["advantages"],
            "rollout_log_probs": padded["rollout_log_prob"],
            "token_level_scores": scores,
        },
        batch_size=[B],
    )
    dense["uid"] = NonTensorStack.from_list([NonTensorData(u) for u in UIDS])
    tu.assign_non_tensor(dense, dp_size=1, batch_num_tokens=sum(R) + 4, global_batch_size=B + 2, max_response_len=T)
    return dense, model_output, leaves, padded


LEGACY = [c for c in CASES if c[0] in ("steer", "gtpo", "pacs", "decoupled_ppo")]


@pytest.mark.parametrize("name, inputs, params, opts", LEGACY, ids=[c[0] for c in LEGACY])
def test_legacy_dense_layout(adapter, declared, name, inputs, params, opts):
    """verl's legacy trainer hands ppo_loss dense padded response fields: same result."""
    data, model_output, leaves, padded = _dense(_batch(seed=13, **opts))
    loss, grad, _ = _through_verl(_config(adapter, name), data, model_output, leaves)
    ref_loss, ref_grad, _ = _direct(name, padded, leaves, inputs, **params)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert grad.abs().sum() > 0


def test_distillation_path_refuses_per_rank_batch_statistics(adapter, declared, core_algos):
    """verl's distillation policy-gradient path calls the loss directly (no ppo_loss, no DP group): a loss
    with batch statistics is refused there with more than one rank, instead of reducing per rank."""
    import verl.trainer.distillation.losses as distill

    assert distill.get_policy_loss_fn is core_algos.get_policy_loss_fn  # what distillation_loss calls
    _, _, _, p = _batch(seed=8)
    fn = core_algos.get_policy_loss_fn("m2po")
    args = dict(old_log_prob=p["old_log_prob"], log_prob=p["log_prob"], advantages=p["advantages"],
                response_mask=p["response_mask"])
    cfg = _config(adapter, "m2po")
    cfg.global_batch_info.update(dp_size=2, batch_num_tokens=int(p["response_mask"].sum()) * 2,
                                 global_batch_size=2 * p["response_mask"].shape[0])
    with pytest.raises(stablerl.StableRLError, match=r"statistics over the whole batch.*distillation"):
        fn(config=cfg, **args)
    cfg.global_batch_info.update(dp_size=1, batch_num_tokens=None, global_batch_size=None)
    loss, _ = fn(config=cfg, **args)  # one rank: the batch is the whole batch
    assert torch.isfinite(loss)


# ----------------------------------------------------------------------------- top_entropy_quantile (issue 16)


def _top_entropy_config(adapter, quantile, **kw):
    from verl.workers.config import FSDPActorConfig

    return FSDPActorConfig(
        strategy="fsdp", rollout_n=3, ppo_micro_batch_size_per_gpu=3, calculate_entropy=True,
        clip_ratio_low=0.2, clip_ratio_high=0.28, clip_ratio_c=10.0,
        policy_loss=adapter.StablePolicyLossConfig(loss_mode="stablerl_vanilla",
                                                   stablerl_params={"top_entropy_quantile": quantile}), **kw,
    )


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean"])
def test_top_entropy_quantile_through_ppo_loss(adapter, declared, agg):
    """+actor_rollout_ref.actor.policy_loss.stablerl_params={top_entropy_quantile:0.3}: verl's ppo_loss feeds
    model_output's entropy (calculate_entropy=True) to stablerl vanilla, which trains on the top 30% of the
    valid tokens by entropy (only they can get a gradient), the aggregation's denominator unchanged."""
    data, model_output, leaves, padded = _batch(seed=11)
    loss, grad, _ = _through_verl(_top_entropy_config(adapter, 0.3, loss_agg_mode=agg), data, model_output, leaves)
    ref_loss, ref_grad, _ = _direct("vanilla", padded, leaves, ("entropy",), top_entropy_quantile=0.3,
                                    loss_agg_mode=agg, **CLIP)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    valid = padded["response_mask"]
    ent = padded["entropy"][valid]
    keep = padded["entropy"] >= torch.quantile(ent, 0.7)
    # (a kept token whose ratio is clipped has no gradient either)
    assert 0 < int((grad != 0).sum()) <= int((keep & valid).sum()) < int(valid.sum())
    # = every token's loss times the mask, over the full denominator
    full_loss = _direct("vanilla", padded, leaves, (), loss_agg_mode=agg, **CLIP)[0]
    assert abs(float(full_loss) - float(loss)) > 1e-6
    weighted = _direct("vanilla", padded, leaves, (), loss_agg_mode=agg, is_weights=(keep & valid).double(), **CLIP)[0]
    torch.testing.assert_close(loss, weighted, rtol=1e-12, atol=1e-14)


def test_top_entropy_quantile_without_entropy_names_the_key(adapter, declared):
    data, model_output, leaves, _ = _batch(seed=12, entropy=False)
    with pytest.raises(stablerl.StableRLError, match=r"actor_rollout_ref\.actor\.calculate_entropy=True"):
        _through_verl(_top_entropy_config(adapter, 0.3), data, model_output, leaves)
    assert declared.current() is None


def test_top_entropy_quantile_bad_value_refused_at_config(adapter):
    with pytest.raises(stablerl.StableRLError, match=r"top_entropy_quantile must be in \(0, 1\]"):
        _top_entropy_config(adapter, 1.5)


# ----------------------------------------------------------------------------- A-3PO: one weight version per batch


def _marked(data, version, lo=None, hi=None):
    """The legacy trainer's batch as the adapter marks it (its weight version in the meta info, which verl hands
    every micro-batch as non-tensor data), with verl's per-trajectory min/max_global_steps when given."""
    from tensordict.tensorclass import NonTensorData, NonTensorStack
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._inputs import VERSION_KEY

    tu.assign_non_tensor(data, **{VERSION_KEY: version})
    for field, values in (("min_global_steps", lo), ("max_global_steps", hi)):
        if values is not None:
            data[field] = NonTensorStack.from_list([NonTensorData(v) for v in values])
    return data


def test_a3po_gets_one_version_per_batch_through_ppo_loss(adapter, declared):
    """verl's synchronous legacy trainer generates a batch with the weights its update starts from: every token is
    of A-3PO's proximal version (v_theta - 1), alpha = 0, and the loss is decoupled PPO with the rollout log-prob as
    the proximal one (behaviour weight 1): PPO's clip of exp(lp - lp_rollout), whatever verl's old_log_probs are."""
    assert set(stablerl.get_spec("policy_loss", "a3po").requires) == {"rollout_log_prob", "versions", "policy_version"}
    data, model_output, leaves, padded = _batch(seed=11)
    loss, grad, metrics = _through_verl(_config(adapter, "a3po"), _marked(data, 4), model_output, leaves)
    versions = torch.full(padded["response_mask"].shape, 4, dtype=torch.long)
    ref_loss, ref_grad, ref_metrics = _direct("a3po", {**padded, "versions": versions, "policy_version": 5}, leaves,
                                              ("rollout_log_prob", "versions", "policy_version"), **CLIP)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-9, atol=1e-12)
    assert metrics["actor/a3po/alpha_mean"] == 0.0 and metrics["actor/behave_imp_weight"] == pytest.approx(1.0)
    # = the plain PPO clip against the rollout log-probs (the proximal policy), verl's old_log_probs unused
    ppo = _direct("vanilla", {**padded, "old_log_prob": padded["rollout_log_prob"]}, leaves, (), **CLIP)
    torch.testing.assert_close(loss, ppo[0], rtol=1e-9, atol=1e-12)
    torch.testing.assert_close(grad, ppo[1], rtol=1e-9, atol=1e-12)
    decoupled = _through_verl(_config(adapter, "decoupled_ppo"), data, model_output, leaves)[0]
    assert abs(float(decoupled) - float(loss)) > 1e-4  # decoupled_ppo's proximal policy is verl's recompute
    # verl's agent loop records each trajectory's weight version: one version throughout is accepted
    same = _marked(_batch(seed=11)[0], 4, [4] * len(R), [4] * len(R))
    torch.testing.assert_close(_through_verl(_config(adapter, "a3po"), same, model_output, leaves)[0], loss,
                               rtol=0, atol=0)
    assert declared.current() is None


def test_a3po_refuses_unmarked_batches_and_several_versions(adapter, declared):
    data, model_output, leaves, _ = _batch(seed=12)
    with pytest.raises(stablerl.StableRLError, match=r"a3po.*legacy trainer \(trainer.use_v1=false\).*no such mark"):
        _through_verl(_config(adapter, "a3po"), data, model_output, leaves)  # the v1 / an asynchronous trainer
    data, model_output, leaves, _ = _batch(seed=12)
    mixed = _marked(data, 3, [3, 3, 3, 3, 3, 2], [3, 3, 3, 3, 3, 3])  # one partial rollout spans versions 2-3
    with pytest.raises(stablerl.StableRLError, match=r"a3po.*weight versions \[2, 3\].*min/max_global_steps"):
        _through_verl(_config(adapter, "a3po"), mixed, model_output, leaves)
    assert declared.current() is None


class _ActorGroup:
    def __init__(self):
        self.batches = []

    def update_actor(self, batch_td):
        from verl.utils import tensordict_utils as tu

        self.batches.append(batch_td)
        return tu.get_tensordict({}, non_tensor_dict={"metrics": {"mfu": 0.0}})


def _legacy_trainer(cls, global_steps):
    from omegaconf import OmegaConf

    trainer = cls.__new__(cls)  # _update_actor reads only these attributes
    trainer.config = OmegaConf.create({
        "actor_rollout_ref": {
            "rollout": {"multi_turn": {"enable": False}, "temperature": 1.0, "n": 2},
            "actor": {"calculate_entropy": False, "entropy_coeff": 0.0, "ppo_mini_batch_size": 2, "ppo_epochs": 1,
                      "data_loader_seed": 0, "shuffle": False}}})
    trainer.actor_rollout_wg = _ActorGroup()
    trainer.global_steps = global_steps
    return trainer


def test_the_legacy_trainer_marks_its_batch_with_the_weight_version(adapter):
    """verl's own RayPPOTrainer._update_actor, wrapped: the batch the workers get carries global_steps - 1 (the
    weights that generated it); the one-step-off / fully-async trainers (verl.experimental) do not mark theirs."""
    from verl.trainer.ppo.ray_trainer import RayPPOTrainer
    from verl.utils import tensordict_utils as tu

    from stablerl.adapters.verl._inputs import VERSION_KEY
    from test_advantage_entropy import _legacy_batch

    assert getattr(RayPPOTrainer._update_actor, "__stablerl_verl_patch__", False)
    trainer = _legacy_trainer(RayPPOTrainer, global_steps=3)
    trainer._update_actor(_legacy_batch()[0])
    assert tu.get_non_tensor_data(trainer.actor_rollout_wg.batches[0], VERSION_KEY, None) == 2
    stale = type("OneStepOffRayTrainer", (RayPPOTrainer,), {"__module__": "verl.experimental.one_step_off_policy.x"})
    trainer = _legacy_trainer(stale, global_steps=3)
    trainer._update_actor(_legacy_batch()[0])
    assert tu.get_non_tensor_data(trainer.actor_rollout_wg.batches[0], VERSION_KEY, None) is None
