"""Name resolution and hyper-parameters of the OpenRLHF adapter: core's one name rule and one precedence
rule (stablerl.frameworks) applied to OpenRLHF's declaration. A module of its own so that the submodules
that resolve names do not import their package."""

from __future__ import annotations

from typing import Any, Optional

from stablerl.contracts import ADVANTAGE_ESTIMATOR as _ADV, POLICY_LOSS as _LOSS

from ._spec import OPENRLHF


def openrlhf_choices(kind: str) -> list[str]:
    """The names the wrapper's argparse lists: OpenRLHF's, then every stablerl algorithm OpenRLHF
    can feed (bare where free, ``stablerl_<name>`` where OpenRLHF has the same name)."""
    from stablerl.frameworks import selectable_names

    return selectable_names(OPENRLHF, kind)


def resolve(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl algorithm ``name`` selects, or None for an OpenRLHF built-in (or None): core's one
    rule for every framework (:func:`stablerl.frameworks.resolve`). Unknown names raise
    :class:`stablerl.UnknownNameError` listing the valid ones; inputs OpenRLHF cannot feed raise
    :class:`stablerl.MissingInputError` saying why."""
    from stablerl.frameworks import resolve as resolve_in

    return resolve_in(OPENRLHF, kind, name)


def extension_choices(kind: str) -> list[str]:
    """The reward shapers / batch filters OpenRLHF can feed (names of the wrapper's argparse choices)."""
    return openrlhf_choices(kind)


def resolve_extension(kind: str, name: Optional[str]) -> Optional[str]:
    """The stablerl reward shaper / batch filter ``name`` (None: none), under the same rule as :func:`resolve`."""
    return resolve(kind, name)


def loss_settings(selection: Any) -> list:
    """``selection``: a ``_selection.Selection``. The effective hyper-parameters of the selected stablerl loss, with their sources (one precedence
    rule, :data:`stablerl.frameworks.PRECEDENCE`): ``--actor.stablerl_params`` > the OpenRLHF clip flags
    given on the command line (``selection.openrlhf_clip``) > the paper's defaults."""
    import stablerl
    from stablerl.frameworks import effective_hyperparameters

    clip = dict(selection.openrlhf_clip or {})
    return effective_hyperparameters(OPENRLHF, stablerl.get_spec(_LOSS, selection.policy_loss),
                                     selection.policy_loss_params, clip, user_set=set(clip))


def advantage_settings(selection: Any) -> list:
    """The effective hyper-parameters of the selected stablerl estimator: ``--algo.advantage.stablerl_params``
    > ``--algo.advantage.no_std_norm`` when given (``selection.openrlhf_advantage``; refused for an
    estimator without a std-normalisation switch) > the paper's defaults."""
    import stablerl
    from stablerl.frameworks import check_framework_keys_used, effective_hyperparameters

    spec = stablerl.get_spec(_ADV, selection.advantage_estimator)
    given = dict(selection.openrlhf_advantage or {})
    check_framework_keys_used(OPENRLHF, spec, given, user_set=set(given))
    return effective_hyperparameters(OPENRLHF, spec, selection.advantage_params, given, user_set=set(given))
