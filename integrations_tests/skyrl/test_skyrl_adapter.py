"""The SkyRL adapter against SkyRL 0.3's real registries, config parser and trainer methods: registration, the
refusals (with their reasons), the take-over of SkyRL's advantage pre-scaling over micro- and mini-batches, and
parity of SkyRL's own built-ins with stablerl's."""

import sys
from pathlib import Path

import pytest

pytest.importorskip("skyrl", reason="SkyRL is not installed (nox -s skyrl installs it)")

import numpy as np  # noqa: E402
import torch  # noqa: E402
from hypothesis import given, settings, strategies as st  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "parity"))

import parity_matrix as M  # noqa: E402
import skyrl_helpers as H  # noqa: E402

import stablerl  # noqa: E402
import stablerl.adapters.skyrl as adapter  # noqa: E402
from stablerl.adapters.skyrl import main  # noqa: E402
from stablerl.adapters.skyrl._loss import StableSkyRLLoss  # noqa: E402


@pytest.fixture(autouse=True)
def _registered():
    adapter.instrument()
    yield
    adapter.uninstrument()


def _registries():
    from skyrl.backends.skyrl_train.utils.ppo_utils import AdvantageEstimatorRegistry, PolicyLossRegistry

    return PolicyLossRegistry._functions, AdvantageEstimatorRegistry._functions


# -- registration --------------------------------------------------------------------------------------------


def test_registration_never_replaces_skyrl_names_and_uninstrument_removes_ours():
    losses, estimators = _registries()
    for own in adapter.SKYRL_POLICY_LOSSES:
        assert not isinstance(losses[own], StableSkyRLLoss), own
    assert "grpo" in estimators and type(estimators["grpo"]).__name__ == "function"
    # SkyRL owns sapo / gspo / grpo: stablerl's are reachable only with the prefix
    assert losses["stablerl_sapo"].name == "sapo" and losses["stablerl_gspo"].name == "gspo"
    assert losses["gmpo"].name == losses["stablerl_gmpo"].name == "gmpo"
    assert estimators["stablerl_grpo"].name == "grpo" and estimators["grpo_passk"].name == "grpo_passk"
    assert losses["pacs"].name == "pacs"  # index / scores carried to the loss (``_micro.ROW_INPUTS``)
    assert "capo" not in losses and "stablerl_capo" not in losses  # refused: SkyRL's loss call has no hidden states
    assert losses["entropic"].name == "entropic"  # the update forward's entropy (``_micro``)
    n_loss = sum(isinstance(f, StableSkyRLLoss) for f in losses.values())
    ours = {f.name for f in losses.values() if isinstance(f, StableSkyRLLoss)}
    # 22 before issue 27, + entropic and steer (the update forward's entropy / token ids), + erc (the old pass's
    # entropy), gtpo, gvpo, pacs, rebel (prompt groups, scores), a3po (one weight version per batch)
    assert len(ours) == 30 and ours & set(adapter.SKYRL_POLICY_LOSSES) == {"sapo", "gspo", "cispo", "clip_cov", "kl_cov"}
    assert n_loss == 2 * 30 - 5  # 30 runnable losses, 5 of them under SkyRL's names (prefixed only)
    adapter.uninstrument()
    assert not any(isinstance(f, StableSkyRLLoss) for f in _registries()[0].values())
    assert "gmpo" not in _registries()[0] and "stablerl_grpo" not in _registries()[1]


def test_registered_objects_pickle_by_reference():
    import cloudpickle

    losses, estimators = _registries()
    blob = cloudpickle.dumps(losses["gmpo"])
    assert b"stablerl.adapters.skyrl._loss" in blob and len(blob) < 300
    assert cloudpickle.loads(blob).name == "gmpo"
    assert cloudpickle.loads(cloudpickle.dumps(estimators["stablerl_grpo"])).name == "grpo"


# -- refusals ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("overrides, error, words", [
    (["trainer.algorithm.policy_loss_type=capo"], stablerl.MissingInputError, ["hidden_states", "_forward_backward_micro"]),
    (["trainer.algorithm.policy_loss_type=pacs", "trainer.micro_train_batch_size_per_gpu=3"], stablerl.StableRLError,
     ["whole prompt groups", "micro_train_batch_size_per_gpu a multiple of generator.n_samples_per_prompt"]),
    (["trainer.algorithm.advantage_estimator=on_policy_distillation"], stablerl.StableRLError,
     ["trainer.ref.model.path=TEACHER", "use_kl_loss=true"]),
    (["trainer.algorithm.policy_loss_type=gmpx"], stablerl.UnknownNameError, ["did you mean 'gmpo'"]),
    (["trainer.algorithm.policy_loss_type=gmpo", "trainer.algorithm.loss_reduction=prompt_mean"],
     stablerl.StableRLError, ["prompt_mean", "refused", "token mean per prompt"]),
    (["trainer.algorithm.policy_loss_type=gmpo", "trainer.algorithm.loss_reduction=token_mean_legacy"],
     stablerl.StableRLError, ["token_mean_legacy", "micro-batch size"]),
    (["trainer.algorithm.policy_loss_type=gmpo", "generator.step_wise_trajectories=true"], stablerl.StableRLError,
     ["step_wise_trajectories", "varying number of rows"]),
    (["trainer.algorithm.policy_loss_type=regular", "trainer.algorithm.stablerl_params.clip_ratio_low=0.1"],
     stablerl.StableRLError, ["SkyRL's own policy loss"]),
    (["trainer.algorithm.policy_loss_type=gmpo", "trainer.algorithm.stablerl_params.clip_ratio_lo=0.1"],
     stablerl.UnknownNameError, ["clip_ratio_lo", "clip_ratio_low"]),
    (["trainer.algorithm.advantage_estimator=opo", "trainer.algorithm.grpo_norm_by_std=false"],
     stablerl.StableRLError, ["grpo_norm_by_std=False", "has no 'norm_adv_by_std_in_grpo'"]),
    (["trainer.algorithm.advantage_estimator=remax"], stablerl.MissingInputError, ["reward_baselines", "greedy"]),
    (["trainer.algorithm.stablerl_batch_filter=shuffle_r1x"], stablerl.UnknownNameError, ["shuffle_r1"]),
])
def test_refused_at_start_up_with_the_reason(overrides, error, words):
    with pytest.raises(error) as info:
        main.check(H.make_config(*overrides))
    for word in words:
        assert word in str(info.value), str(info.value)


def test_loss_refuses_advantages_skyrl_prescaled():
    cfg = H.make_config("trainer.algorithm.policy_loss_type=gmpo")  # not through the entry point: flag unset
    b = M.loss_batch()
    with pytest.raises(stablerl.StableRLError, match="pre-scales the advantages.*stablerl.adapters.skyrl.main"):
        _registries()[0]["gmpo"](b["log_prob"], b["old_log_prob"], b["advantages"], config=cfg.trainer.algorithm,
                                 loss_mask=b["response_mask"].float())


@settings(max_examples=25, deadline=None)
@given(value=st.one_of(st.floats(max_value=-1e-3, allow_nan=False), st.just(float("nan")), st.text(max_size=3)))
def test_bad_hyperparameter_values_name_the_key(value):
    cfg = H.make_config("trainer.algorithm.policy_loss_type=gmpo")
    cfg.trainer.algorithm.stablerl_params = {"clip_ratio_high": value}
    with pytest.raises((stablerl.StableRLError, ValueError, TypeError)) as info:
        main.check(cfg)
    assert "clip_ratio_high" in str(info.value)


# -- SkyRL's pre-scaling taken over: micro- and mini-batches --------------------------------------------------


@pytest.mark.parametrize("name", ["vanilla", "gmpo", "gspo", "sapo", "cispo", "luspo"])
@pytest.mark.parametrize("reduction, mode", [("token_mean", "token-mean"), ("sequence_mean", "seq-mean-token-mean"),
                                             ("seq_mean_token_sum_norm", "seq-mean-token-sum-norm")])
def test_micro_batches_sum_to_the_mini_batch_loss(name, reduction, mode):
    b = M.loss_batch()
    spec = stablerl.get_spec(stablerl.POLICY_LOSS, name)
    cfg = H.make_config(f"trainer.algorithm.policy_loss_type={M.selection_name('skyrl', spec)}",
                        f"trainer.algorithm.loss_reduction={reduction}", "trainer.algorithm.max_seq_len=9",
                        "trainer.algorithm.stablerl_reduction=true")
    ref_leaf = b["log_prob"].clone().requires_grad_(True)
    mask = b["response_mask"]
    ctx = stablerl.Context(token_count=float(mask.sum()), seq_count=float(mask.shape[0]), loss_scale_factor=9.0)
    ref, _ = stablerl.compute_policy_loss(name, log_prob=ref_leaf, old_log_prob=b["old_log_prob"],
                                          advantages=b["advantages"], response_mask=mask, loss_agg_mode=mode, ctx=ctx)
    (ref_grad,) = torch.autograd.grad(ref, ref_leaf)
    for micro in (1, 3, 8):
        loss, grad = H.worker_loss(cfg, b, micro=micro)
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(grad, ref_grad, rtol=1e-6, atol=1e-8)
    assert ref_grad.abs().sum() > 0


def test_two_mini_batches_are_normalised_each_on_its_own():
    b = M.loss_batch()
    cfg = H.make_config("trainer.algorithm.policy_loss_type=vanilla", "trainer.algorithm.stablerl_reduction=true")
    data = H.normalized_batch(cfg, b["advantages"], b["response_mask"], boundaries=[(0, 4), (4, 8)])
    mask = b["response_mask"]
    torch.testing.assert_close(data["advantages"], b["advantages"].float())  # unscaled
    for rows in (slice(0, 4), slice(4, 8)):
        weights = data["loss_mask"][rows][mask[rows]]
        assert torch.all(weights == 1.0 / float(mask[rows].sum()))  # 1/D: this mini-batch's tokens
    assert torch.all(data["loss_mask"][~mask] == 0)


# -- parity of SkyRL's own built-ins with stablerl's ----------------------------------------------------------


def _skyrl_builtin_loss(skyrl_name, b, reduction, *extra):
    """SkyRL's own loss as its trainer and worker run it: SkyRL's pre-scaling, micro-batches of 3, summed."""
    from skyrl.backends.skyrl_train.utils.ppo_utils import PolicyLossRegistry

    cfg = H.make_config(f"trainer.algorithm.policy_loss_type={skyrl_name}",
                        f"trainer.algorithm.loss_reduction={reduction}", *extra)
    data = H.normalized_batch(cfg, b["advantages"], b["response_mask"])
    leaf = b["log_prob"].clone().requires_grad_(True)
    total = 0.0
    for start in range(0, 8, 3):
        rows = slice(start, start + 3)
        loss, _ = PolicyLossRegistry.get(skyrl_name)(leaf[rows], b["old_log_prob"][rows], data["advantages"][rows],
                                                     config=cfg.trainer.algorithm, loss_mask=data["loss_mask"][rows])
        total = total + loss
    (grad,) = torch.autograd.grad(total, leaf)
    return total.detach(), grad


_SKYRL_CLIPS = {"clip_ratio_low": 0.2, "clip_ratio_high": 0.2}  # SkyRL's eps_clip_low / eps_clip_high defaults


@pytest.mark.parametrize("skyrl_name, name, reduction, mode, params, same_value", [
    ("regular", "vanilla", "token_mean", "token-mean", {**_SKYRL_CLIPS, "clip_ratio_c": None}, True),
    ("regular", "vanilla", "sequence_mean", "seq-mean-token-mean", {**_SKYRL_CLIPS, "clip_ratio_c": None}, True),
    ("dual_clip", "vanilla", "token_mean", "token-mean", {**_SKYRL_CLIPS, "clip_ratio_c": 3.0}, True),
    # SkyRL's CISPO loss is -A * sg(clip(r)) * log_prob (the same gradient, another value); its bounds
    # 1 - cispo_eps_clip_low = 1 and 1 + cispo_eps_clip_high = 6
    ("cispo", "cispo", "token_mean", "token-mean", {"clip_ratio_low": 0.0, "clip_ratio_high": 5.0}, False),
])
def test_skyrl_builtin_loss_equals_stablerl(skyrl_name, name, reduction, mode, params, same_value):
    b = M.loss_batch()
    loss, grad = _skyrl_builtin_loss(skyrl_name, b, reduction)
    leaf = b["log_prob"].clone().requires_grad_(True)
    ref, _ = stablerl.compute_policy_loss(name, log_prob=leaf, old_log_prob=b["old_log_prob"],
                                          advantages=b["advantages"], response_mask=b["response_mask"],
                                          loss_agg_mode=mode, **params)
    (ref_grad,) = torch.autograd.grad(ref, leaf)
    if same_value:
        torch.testing.assert_close(loss, ref.detach(), rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(grad, ref_grad, rtol=1e-5, atol=1e-7)
    assert ref_grad.abs().sum() > 0


@pytest.mark.parametrize("skyrl_name, name", [("grpo", "grpo"), ("rloo", "rloo"),
                                              ("reinforce++", "reinforce_plus_plus")])
@pytest.mark.parametrize("norm", [True, False])
def test_skyrl_builtin_estimator_equals_stablerl(skyrl_name, name, norm):
    from skyrl.backends.skyrl_train.utils import ppo_utils

    b = M.reward_batch()
    cfg = H.make_config(f"trainer.algorithm.advantage_estimator={skyrl_name}",
                        f"trainer.algorithm.grpo_norm_by_std={str(norm).lower()}").trainer.algorithm
    index = np.array([str(int(i)) for i in b["index"]])
    ours, _ = ppo_utils.compute_advantages_and_returns(
        token_level_rewards=b["token_level_rewards"].clone(), response_mask=b["response_mask"], index=index,
        adv_estimator=skyrl_name, config=cfg, values=None, gamma=1.0, lambd=1.0, grpo_norm_by_std=norm)
    params = {"norm_adv_by_std_in_grpo": norm} if "norm_adv_by_std_in_grpo" in stablerl.get_spec(
        stablerl.ADVANTAGE_ESTIMATOR, name).defaults() else {}
    ref, _ = stablerl.compute_advantage(name, token_level_rewards=b["token_level_rewards"],
                                        response_mask=b["response_mask"], index=b["index"], **params)
    torch.testing.assert_close(ours * b["response_mask"], ref * b["response_mask"], rtol=1e-5, atol=1e-6)


# -- the entry point trainer's advantage step: shaper -> SkyRL's estimator call -> filter -> state ------------


def _trainer_with(*overrides):
    from stablerl.adapters.skyrl._trainer import StableRayPPOTrainer

    cfg = H.make_config(*overrides)
    trainer = StableRayPPOTrainer.__new__(StableRayPPOTrainer)
    trainer.cfg, trainer.all_metrics = cfg, {}
    StableRayPPOTrainer._stablerl_setup(trainer)
    return trainer


def _training_input(b):
    from skyrl.backends.skyrl_train.training_batch import TrainingInputBatch

    n = b["response_mask"].shape[0]
    data = TrainingInputBatch({"rewards": b["token_level_rewards"].clone(), "response_mask": b["response_mask"].long(),
                               "loss_mask": b["response_mask"].long(), "values": None,
                               "action_log_probs": b["old_log_prob"].clone()})
    data.metadata = {"uids": [str(int(i)) for i in b["index"]], "avg_response_length": 3.0, "pad_size": 0}
    assert len(data) == n
    return data


def test_trainer_advantage_step_filters_rows_and_advances_the_state():
    b = M.reward_batch()
    trainer = _trainer_with("trainer.algorithm.advantage_estimator=stablerl_grpo",
                            "trainer.algorithm.stablerl_batch_filter=dynamic_sampling")
    state = adapter.SkyRLAdapter().driver_state
    before = state.step
    data = trainer.compute_advantages_and_returns(_training_input(b))
    ref, _ = stablerl.compute_advantage("grpo", token_level_rewards=b["token_level_rewards"],
                                        response_mask=b["response_mask"], index=b["index"])
    mask = b["response_mask"]
    # the third group has equal rewards: dynamic sampling drops it (loss mask 0), the others keep grpo's advantages
    kept = torch.tensor([1.0] * 8 + [0.0] * 4).unsqueeze(1) * mask
    torch.testing.assert_close(data["loss_mask"].float(), kept)
    torch.testing.assert_close(data["advantages"] * kept, ref * kept, rtol=1e-6, atol=1e-7)
    assert state.step == before + 1 and adapter.SkyRLAdapter().pending is None
    assert any(k.startswith("stablerl/") for k in trainer.all_metrics)


def test_trainer_reward_shaper_changes_skyrls_own_estimator_input():
    b = M.reward_batch()
    trainer = _trainer_with("trainer.algorithm.advantage_estimator=grpo",  # SkyRL's own estimator
                            "trainer.algorithm.stablerl_reward_shaper=redit",
                            "trainer.algorithm.stablerl_reward_shaper_params.scale=0.5")
    data = trainer.compute_advantages_and_returns(_training_input(b))
    plain = _trainer_with("trainer.algorithm.advantage_estimator=grpo").compute_advantages_and_returns(
        _training_input(b))
    mask = b["response_mask"]
    # ReDit's noise makes the equal-reward group's advantages non-zero; without it they are 0
    assert float((plain["advantages"][8:] * mask[8:]).abs().max()) == 0.0
    assert float((data["advantages"][8:] * mask[8:]).abs().max()) > 0.1


#: shapers / filters reachable since issue 27: the old-log-prob pass's entropy, the environments' per-trajectory values
NEW_EXTENSIONS = [("stablerl_batch_filter", "d3s"), ("stablerl_batch_filter", "gtpo_entropy_filter"),
                  ("stablerl_batch_filter", "simpletir"), ("stablerl_reward_shaper", "fapo"),
                  ("stablerl_reward_shaper", "grpo_lambda")]


@pytest.mark.parametrize("key, name", NEW_EXTENSIONS)
def test_trainer_shaper_or_filter_reading_old_pass_and_env_values_equals_core(key, name):
    """The entry point trainer's advantage step with the batch fields its old-log-prob pass (``stablerl_old_entropy``)
    and ``convert_to_training_input`` (``stablerl_correct`` / ``_flawed`` / ``_void_turn``) put there, against core's
    AdvantageStep on the same inputs with a fresh state."""
    from stablerl.state import StateStore
    from stablerl.steps import AdvantageSelection, AdvantageStep, BatchRecord

    b = M.reward_batch()
    trainer = _trainer_with("trainer.algorithm.advantage_estimator=stablerl_grpo", f"trainer.algorithm.{key}={name}")
    trainer.total_training_steps = 10  # SkyRL's (d3s schedules by training progress)
    adapter.SkyRLAdapter().driver_state.clear()
    correct = b["scores"] >= 0.75
    values = {"entropy": b["entropy"], "correct": correct, "flawed": correct & (torch.arange(12) % 3 == 0),
              "void_turn": torch.arange(12) % 5 == 1, "lengths": b["response_mask"].sum(-1)}
    data = _training_input(b)
    data["stablerl_old_entropy"] = b["entropy"].clone()
    for what in ("correct", "flawed", "void_turn"):
        data["stablerl_" + what] = values[what]
    data = trainer.compute_advantages_and_returns(data)
    sel = AdvantageSelection(estimator="grpo", **({"batch_filter": name} if "filter" in key else {"reward_shaper": name}))
    store = StateStore(holds="driver")
    record = BatchRecord(response_mask=b["response_mask"], index=b["index"], token_level_rewards=b["token_level_rewards"],
                         produced=values)
    ref = AdvantageStep(sel, ctx=lambda kind, n: store.context(kind, n, trainer.stablerl_adapter.seed, total_steps=10)
                        ).run(record)
    mask = ref.response_mask.float()
    torch.testing.assert_close(data["loss_mask"].float(), mask)
    torch.testing.assert_close(data["advantages"] * mask, ref.advantages * mask, rtol=1e-6, atol=1e-7)
    assert float((ref.advantages * mask).abs().sum()) > 0


def test_teacher_is_the_reference_model_with_the_policy_vocabulary(tmp_path):
    """on_policy_distillation: SkyRL's reference model loads the teacher (trainer.ref.model.path) when its
    vocabulary is the policy's (core's check on the two checkpoints' configs), else refused before Ray starts."""
    from transformers import Qwen3Config

    paths = {}
    for name, vocab in (("student", 32), ("teacher", 32), ("other", 48)):
        Qwen3Config(vocab_size=vocab, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                    num_key_value_heads=1, intermediate_size=16).save_pretrained(tmp_path / name)
        paths[name] = tmp_path / name

    def cfg(ref):
        return H.make_config("trainer.algorithm.advantage_estimator=on_policy_distillation",
                             "trainer.algorithm.use_kl_loss=true", f"trainer.policy.model.path={paths['student']}",
                             f"trainer.ref.model.path={paths[ref]}")

    main.check(cfg("teacher"))
    with pytest.raises(stablerl.StableRLError, match="teacher's vocabulary has 48 tokens and the student's 32"):
        main.check(cfg("other"))
    with pytest.raises(stablerl.StableRLError, match="use_kl_loss=true"):
        main.check(cfg("student"))  # the reference is the policy itself: no teacher
