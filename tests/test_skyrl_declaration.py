"""SkyRL's declaration without SkyRL installed (torch only): `stablerl list` / `describe --framework skyrl`, names,
precedence and refusals in SkyRL's words; the adapter package imports no SkyRL module."""

import json
import subprocess
import sys

import pytest

import stablerl
from stablerl import cli
from stablerl import frameworks as F
from stablerl.contracts import ADVANTAGE_ESTIMATOR, POLICY_LOSS


def test_describe_with_the_skyrl_framework(capsys):
    assert cli.main(["describe", "gmpo", "--framework", "skyrl"]) == 0
    out = capsys.readouterr().out
    assert "python -m stablerl.adapters.skyrl.main ..." in out
    assert "trainer.algorithm.policy_loss_type=gmpo" in out
    assert "stablerl/skyrl: policy loss 'gmpo' runs with:" in out
    assert "note: trainer.algorithm.eps_clip_low=0.2 is skyrl's default, not applied" in out
    assert cli.main(["describe", "grpo", "--framework", "skyrl"]) == 0
    assert "trainer.algorithm.advantage_estimator=stablerl_grpo" in capsys.readouterr().out


def test_list_has_a_skyrl_column(capsys):
    assert cli.main(["list", "--json"]) == 0
    rows = {(r["kind"], r["name"]): r for r in json.loads(capsys.readouterr().out)}
    assert rows[(POLICY_LOSS, "gmpo")]["reach"]["skyrl"] == {"status": "selectable", "name": "gmpo"}
    assert rows[(POLICY_LOSS, "sapo")]["reach"]["skyrl"] == {"status": "selectable", "name": "stablerl_sapo"}
    assert rows[(POLICY_LOSS, "entropic")]["reach"]["skyrl"]["status"] == "selectable"  # the update's entropy
    pacs = rows[(POLICY_LOSS, "pacs")]["reach"]["skyrl"]
    assert pacs["status"] == "partial" and "micro_train_batch_size_per_gpu a multiple of" in pacs["needs"][0]
    capo = rows[(POLICY_LOSS, "capo")]["reach"]["skyrl"]
    assert capo["status"] == "refused" and "PolicyWorkerBase._forward_backward_micro" in capo["why"]
    counts = F.reach_counts(F.reach_table())["skyrl"]
    # 35 when SkyRL landed, + on_policy_distillation and generalized_jsd (teacher inputs SkyRL does not feed)
    # 47 / 32 before issue 27; + entropic and steer (the update forward's entropy and token ids, ``_micro``) 49 / 30;
    # + the old pass's entropy / sum_pi_squared, prompt groups and scores at the loss, a3po, the teacher, env values
    assert counts["selectable"] >= 55 and counts["selectable"] + counts["partial"] >= 74 and counts["refused"] <= 15


def test_names_precedence_and_refusals_in_skyrls_words():
    assert F.resolve("skyrl", POLICY_LOSS, "sapo") is None  # SkyRL's own
    assert F.resolve("skyrl", POLICY_LOSS, "stablerl_sapo") == "sapo"
    assert F.resolve("skyrl", ADVANTAGE_ESTIMATOR, "grpo_passk") == "grpo_passk"
    with pytest.raises(stablerl.MissingInputError, match="hidden_states: SkyRL's loss call"):
        F.resolve("skyrl", POLICY_LOSS, "capo")
    assert F.resolve("skyrl", POLICY_LOSS, "gtpo") == "gtpo"  # prompt groups carried to the loss (issue 27)
    spec = stablerl.get_spec(POLICY_LOSS, "vanilla")
    s = {x.name: x for x in F.effective_hyperparameters("skyrl", spec, {"clip_ratio_c": 2.0},
                                                         {"clip_ratio_low": 0.1, "clip_ratio_high": 0.2})}
    assert s["clip_ratio_c"].source == F.FROM_STABLERL_KEY
    assert s["clip_ratio_c"].key == "trainer.algorithm.stablerl_params.clip_ratio_c=2.0"
    assert s["clip_ratio_low"].source == F.FROM_FRAMEWORK_KEY and s["clip_ratio_low"].value == 0.1
    assert s["clip_ratio_high"].source == F.FROM_PAPER_DEFAULT and s["clip_ratio_high"].value == 0.28
    assert "trainer.algorithm.eps_clip_high=0.2 is skyrl's default" in s["clip_ratio_high"].note
    with pytest.raises(stablerl.StableRLError, match="grpo_norm_by_std=False has no effect"):
        F.check_framework_keys_used("skyrl", stablerl.get_spec(ADVANTAGE_ESTIMATOR, "opo"),
                                    {"norm_adv_by_std_in_grpo": False})


def test_the_adapter_package_imports_no_skyrl():
    code = ("import sys, stablerl.adapters.skyrl, stablerl.adapters.skyrl._spec, stablerl.adapters.skyrl._config;"
            "print(sorted(m for m in sys.modules if m == 'skyrl' or m.startswith('skyrl.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
