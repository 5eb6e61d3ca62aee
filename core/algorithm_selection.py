"""What a user selected in one framework, as every adapter holds it: per kind, a stablerl algorithm name (None: the
framework's own, or nothing) and its hyper-parameters; and the questions each adapter asks of it: which inputs the
selected algorithms read (an input that costs a pass of its own is computed only then), whether the advantage step
has a shaper or filter, and the shaper / filter / controller parameters checked before the framework starts.
An adapter subclasses it with its framework's own knobs (see ``stablerl.adapters.openrlhf``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

from .contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER
from .params import StableRLError, build_params


@dataclass
class AlgorithmSelection:
    policy_loss: Optional[str] = None
    policy_loss_params: dict = field(default_factory=dict)
    advantage_estimator: Optional[str] = None
    advantage_params: dict = field(default_factory=dict)
    reward_shaper: Optional[str] = None
    reward_shaper_params: dict = field(default_factory=dict)
    batch_filter: Optional[str] = None
    batch_filter_params: dict = field(default_factory=dict)
    entropy_controller: Optional[str] = None
    entropy_controller_params: dict = field(default_factory=dict)
    #: the reward function's per-response values handed to the estimator as reward_components (GDPO), their weights
    reward_components: tuple = ()
    reward_weights: tuple = ()

    def name(self, kind: str) -> Optional[str]:
        """The stablerl algorithm selected for ``kind`` (None: none, or the framework's own)."""
        return {POLICY_LOSS: self.policy_loss, ADVANTAGE_ESTIMATOR: self.advantage_estimator,
                REWARD_SHAPER: self.reward_shaper, BATCH_FILTER: self.batch_filter,
                CONTROLLER: self.entropy_controller}[kind]

    def requires(self, kind: str, what: str) -> bool:
        """Whether the selected algorithm of ``kind`` declares input ``what``."""
        from .api import get_spec

        name = self.name(kind)
        return name is not None and what in get_spec(kind, name).requires

    def old_pass_stats(self) -> frozenset:
        """The per-token statistics the old-log-prob pass must also return: ``entropy`` for a loss declaring
        ``old_entropy`` or an estimator / shaper / filter declaring ``entropy`` (they run after that pass), and
        ``sum_pi_squared`` for an estimator declaring it (optimal_token_baseline)."""
        entropy = self.requires(POLICY_LOSS, "old_entropy") or any(
            self.requires(kind, "entropy") for kind in (ADVANTAGE_ESTIMATOR, REWARD_SHAPER, BATCH_FILTER))
        return frozenset({"entropy"} if entropy else ()) | frozenset(
            {"sum_pi_squared"} if self.requires(ADVANTAGE_ESTIMATOR, "sum_pi_squared") else ())

    @property
    def has_extensions(self) -> bool:
        """A reward shaper or a batch filter is selected (the advantage step runs around any estimator)."""
        return self.reward_shaper is not None or self.batch_filter is not None

    def advantage_selection(self, estimator_params: Optional[dict] = None):
        """The selection of core's advantage step (:class:`stablerl.steps.AdvantageSelection`); ``estimator_params``:
        the estimator's effective hyper-parameters (default: the stablerl keys the user set)."""
        from .steps import AdvantageSelection

        return AdvantageSelection(self.advantage_estimator, dict(self.advantage_params if estimator_params is None
                                                                  else estimator_params),
                                  self.reward_shaper, self.reward_shaper_params, self.batch_filter,
                                  self.batch_filter_params)

    def check_extensions(self, key: Callable[[str], str], params_key: Callable[[str], str], components_key: str,
                         weights_key: str) -> None:
        """Build the shaper's, filter's and controller's parameters now (a bad key fails before the framework
        starts); parameters without a name, or reward weights not one per component, are refused naming the user's
        keys (``key(kind)``: the one selecting an algorithm of ``kind``, ``params_key(kind)``: its parameters')."""
        from .api import get_spec

        if self.reward_weights and len(self.reward_weights) != len(self.reward_components):
            raise StableRLError(f"{weights_key} has {len(self.reward_weights)} values for "
                                f"{len(self.reward_components)} {components_key} names")
        for kind, params in ((REWARD_SHAPER, self.reward_shaper_params), (BATCH_FILTER, self.batch_filter_params),
                             (CONTROLLER, self.entropy_controller_params)):
            name = self.name(kind)
            if name is not None:
                build_params(get_spec(kind, name), params)
            elif params:
                raise StableRLError(f"{params_key(kind)} given, but no {key(kind)}")


__all__ = ["AlgorithmSelection"]
