"""Parity of stablerl's copies of OpenRLHF 0.11.2's estimators with OpenRLHF's own (issue 16).

``reinforce``, ``reinforce_baseline`` and ``flash_reinforce`` through the real
``RemoteExperienceMaker.compute_advantages_and_returns``: OpenRLHF's branch against stablerl's estimator
selected as ``stablerl_<name>`` (OpenRLHF owns the names). With ``kl_coef = 0``: OpenRLHF folds the KL reward
in before its whitening, while the adapter adds it to a stablerl estimator's advantages afterwards (the
KL-in-reward is the framework's, never normalised there), so with a KL penalty the whitened estimators
differ by design.
"""

import pytest

pytest.importorskip("openrlhf", reason="OpenRLHF is not installed (nox -s openrlhf installs it)")

import torch
from orlhf_helpers import clone, make_experiences
from test_openrlhf_advantage import _openrlhf, _stable


def _compare(ours, ref):
    for o, r in zip(ours, ref):
        m = o.action_mask
        # OpenRLHF leaves (x - mean) * rstd on padding; stablerl gives 0 there (never read by the loss)
        torch.testing.assert_close(o.advantages * m, r.advantages * m, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(o.info["return"], r.info["return"], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("name", ["reinforce", "reinforce_baseline", "flash_reinforce"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_reinforce_family_equals_openrlhf(name, seed):
    exps = make_experiences(seed=seed, kl_scale=0.3)
    ref = _openrlhf(name, clone(exps), kl_coef=0.0)
    out = _stable("stablerl_" + name, clone(exps), None, kl_coef=0.0)
    _compare(out, ref)
    adv = torch.cat([(r.advantages * r.action_mask).flatten() for r in ref])
    assert float(adv.abs().max()) > 0.5


@pytest.mark.parametrize("name", ["reinforce", "reinforce_baseline"])
def test_no_std_norm_centres_only(name):
    exps = make_experiences(seed=3)
    ref_args = _openrlhf.__globals__["make_args"](estimator=name)
    ref_args.algo.advantage.no_std_norm = True
    from test_openrlhf_advantage import ORIGINAL
    from orlhf_helpers import make_maker

    ref = ORIGINAL(make_maker(ref_args, name, 0.0), clone(exps))
    out = _stable("stablerl_" + name, clone(exps), None, kl_coef=0.0, framework={"norm_adv_by_std_in_grpo": False})
    _compare(out, ref)
