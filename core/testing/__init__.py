"""The conformance suite: what every stablerl policy loss and advantage estimator must satisfy.

Plugin authors run it with pytest against their own package (every built-in passes it too)::

    import pytest
    from stablerl.testing import conformance_cases

    @pytest.mark.parametrize("case", conformance_cases(plugin="my_plugin"))
    def test_conformance(case):
        case.run()

or call the checks directly: ``check_policy_loss("my_loss", clip=0.2)``,
``check_advantage_estimator("my_estimator")``, ``check_two_rank_equality("my_loss")``.
A failed check raises :class:`ConformanceError` (an ``AssertionError``) whose message names the
algorithm and the property, e.g. ``policy loss 'my_loss' fails 'masked_tokens': ...``.

Policy-loss properties (names accepted by ``skip=``):

* ``spec``: ``formula`` non-empty; built-ins also have ``paper``, ``title``, and ``notes`` when
  experimental; every ``Params`` field has a default and the defaults validate.
* ``output``: the loss is a 0-dim, finite tensor (fp32 for fp32/bf16 inputs; fp64, or fp32,
  for fp64 inputs) whose gradient reaches ``log_prob`` on valid tokens and is finite everywhere.
* ``masked_tokens``: masked tokens get exactly zero gradient, and what padded positions hold
  (finite garbage) changes neither the loss nor the gradient of valid tokens.
* ``detached_inputs``: nothing but ``log_prob`` carries gradient (``old_log_prob``,
  ``advantages``, ``is_weights`` and every declared floating input passed with
  ``requires_grad=True`` receive none).
* ``is_weights``: framework IS weights of 1 change nothing; weights of 0.5 are not ignored
  (a loss may instead refuse IS weights with a ``StableRLError`` that says why).
* ``bf16``: bf16 inputs give a finite fp32 loss close to the fp32 loss of the same inputs.
* ``padding_length``: extra padded columns change neither the loss nor the valid gradient.
* ``micro_batch``: with token-mean and the global ``Context.token_count``, the summed losses and
  gradients of two row micro-batches equal the whole-batch ones. Skipped for algorithms that
  take batch statistics (``AlgorithmSpec.batch_statistics=True``, or seen calling
  ``ctx.all_reduce``/``ctx.all_gather``); :func:`check_two_rank_equality` covers those.
* ``batch_statistics``: an algorithm seen reducing over the batch declares
  ``batch_statistics=True`` (users and docs rely on it). The flag may also be set, with the
  reason in ``notes``, by an algorithm whose statistics are per call by design (e.g. verl's
  per-micro-batch Clip-Cov/KL-Cov selection).
* ``degenerate``: an all-masked row and an all-masked batch give a finite loss (0 for the
  latter) and zero gradient there.
* ``declared_inputs``: leaving out an input named in ``spec.requires`` raises
  ``stablerl.MissingInputError``.
* ``undeclared_inputs``: giving every input in neither ``spec.requires`` nor
  ``spec.optional_inputs`` changes nothing, bit for bit (adapters leave those out); an optional
  input, given, still yields a finite loss. Only torch's global generator is reset between the two
  runs: a loss drawing from other random sources (numpy, its own state) skips this property.
* ``metrics``: plain finite floats, the same keys on two calls, each listed in ``spec.metrics``
  (which may also list metrics that only some hyper-parameter settings emit).

Advantage-estimator properties: ``spec``, ``shapes`` (advantages and returns ``[B, T]``),
``masked`` (exactly 0 outside the mask), ``finite``, ``masked_content`` (reward values outside
the mask are ignored), ``padding_length``, ``group_of_one``, ``equal_rewards``, ``permutation``
(shuffling rows with their uids permutes the output identically), ``bf16``,
``declared_inputs``, ``batch_statistics``. An estimator may refuse groups of one with a
``StableRLError`` that says why.

:func:`check_two_rank_equality` is the check for algorithms that reduce through ``ctx``;
:func:`conformance_cases` adds it (case id ``<name>-two_rank``) for every algorithm seen calling
``ctx.all_reduce``/``ctx.all_gather``.

Inputs named in ``spec.requires`` are synthesised (``rollout_log_prob``, ``entropy``,
``old_entropy``, ``token_ids``, ``index``, ``turn_ids``, ``versions``, ``policy_version``,
``scores``, ``old_log_prob``, ``router_log_prob``, ``old_router_log_prob``, ``hidden_states``,
``lm_head_weight``); pass ``inputs={"name": value_or_fn}`` for anything else, where a
function receives the base batch dict and returns the value (an estimator's ``extras`` dict
goes in as ``inputs={"extras": fn}``; its ``[B]`` tensors follow row selections and shuffles).

Reward shapers, batch filters, controllers, rollout corrections and router families have their own
properties and ``check_*`` functions (:mod:`stablerl.testing.extensions` lists them);
:func:`conformance_cases` covers every kind.

Layout: :mod:`.batches` (synthetic batches), :mod:`.losses` and :mod:`.estimators` (the properties
of each kind), :mod:`.extensions` (the other kinds), :mod:`.shared` (what both kinds share), :mod:`.distributed` (the gloo launcher and
the two-rank check), :mod:`.cases` (pytest parametrisation). Import from ``stablerl.testing``.
"""

from __future__ import annotations

from .batches import advantage_batch, policy_batch
from .cases import CONFORMANCE_KINDS, ConformanceCase, conformance_cases
from .common import ConformanceError
from .distributed import GlooLaunchError, check_two_rank_equality, launch_gloo, run_two_rank
from .estimators import ADVANTAGE_ESTIMATOR_PROPERTIES, check_advantage_estimator
from .extensions import (
    BATCH_FILTER_PROPERTIES,
    CONTROLLER_PROPERTIES,
    REWARD_SHAPER_PROPERTIES,
    ROLLOUT_CORRECTION_PROPERTIES,
    ROUTER_FAMILY_PROPERTIES,
    TRAINER_HOOK_PROPERTIES,
    check_batch_filter,
    check_controller,
    check_reward_shaper,
    check_rollout_correction,
    check_router_family,
    check_trainer_hook,
)
from .losses import POLICY_LOSS_PROPERTIES, check_policy_loss
from .shared import uses_batch_reductions

__all__ = [
    "ConformanceError",
    "POLICY_LOSS_PROPERTIES",
    "ADVANTAGE_ESTIMATOR_PROPERTIES",
    "check_policy_loss",
    "check_advantage_estimator",
    "check_two_rank_equality",
    "conformance_cases",
    "ConformanceCase",
    "uses_batch_reductions",
    "run_two_rank",
    "launch_gloo",
    "GlooLaunchError",
    "policy_batch",
    "advantage_batch",
    "CONFORMANCE_KINDS",
    "REWARD_SHAPER_PROPERTIES",
    "BATCH_FILTER_PROPERTIES",
    "CONTROLLER_PROPERTIES",
    "ROLLOUT_CORRECTION_PROPERTIES",
    "ROUTER_FAMILY_PROPERTIES",
    "check_reward_shaper",
    "check_batch_filter",
    "check_controller",
    "check_rollout_correction",
    "check_router_family",
    "TRAINER_HOOK_PROPERTIES",
    "check_trainer_hook",
]
