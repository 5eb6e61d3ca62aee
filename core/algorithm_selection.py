"""What a user selected in one framework, as every adapter holds it: per kind, a stablerl algorithm name (None: the
framework's own, or nothing) and its hyper-parameters; and the questions each adapter asks of it: which inputs the
selected algorithms read (an input that costs a pass of its own is computed only then), whether the advantage step
has a shaper or filter, and the shaper / filter / controller parameters checked before the framework starts.
An adapter subclasses it with its framework's own knobs (see ``stablerl.adapters.openrlhf``): it names its framework
(:attr:`framework`, :attr:`label`), overrides :meth:`loss_settings` / :meth:`advantage_settings` where framework
knobs also set hyper-parameters, and gets :meth:`validate` and :meth:`from_env` (the ``STABLERL_*`` route)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, ClassVar, Mapping, Optional

from .contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, CONTROLLER, POLICY_LOSS, REWARD_SHAPER
from .params import StableRLError, build_params


#: kind -> the fields holding its algorithm's name and its hyper-parameters
FIELDS = {POLICY_LOSS: ("policy_loss", "policy_loss_params"),
          ADVANTAGE_ESTIMATOR: ("advantage_estimator", "advantage_params"),
          REWARD_SHAPER: ("reward_shaper", "reward_shaper_params"), BATCH_FILTER: ("batch_filter", "batch_filter_params"),
          CONTROLLER: ("entropy_controller", "entropy_controller_params")}


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

    #: the framework (its ``FrameworkSpec`` name), how messages call it, and its keys of the reward components
    framework: ClassVar[str] = ""
    label: ClassVar[str] = ""
    components_key: ClassVar[str] = "reward_components"
    weights_key: ClassVar[str] = "reward_weights"

    def name(self, kind: str) -> Optional[str]:
        """The stablerl algorithm selected for ``kind`` (None: none, or the framework's own)."""
        return getattr(self, FIELDS[kind][0])

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

    def loss_settings(self) -> list:
        """The loss's effective hyper-parameters with their sources (:func:`stablerl.frameworks.
        effective_hyperparameters`); a subclass adds the framework knobs that also set them."""
        from .api import get_spec
        from .settings import effective_hyperparameters

        return effective_hyperparameters(self.framework, get_spec(POLICY_LOSS, self.policy_loss),
                                         self.policy_loss_params)

    def advantage_settings(self) -> list:
        """The estimator's effective hyper-parameters with their sources (as :meth:`loss_settings`)."""
        from .api import get_spec
        from .settings import effective_hyperparameters

        return effective_hyperparameters(self.framework, get_spec(ADVANTAGE_ESTIMATOR, self.advantage_estimator),
                                         self.advantage_params)

    def effective_loss_params(self, logger: Any = None) -> tuple[dict, dict]:
        """``(hyper-parameters, call options)`` of the selected loss, from :meth:`loss_settings`; the
        effective-settings table is printed once per process (:func:`stablerl.frameworks.log_effective_settings`)."""
        from .api import get_spec
        from .call_options import split_call_options
        from .settings import as_params, log_effective_settings

        settings = self.loss_settings()
        log_effective_settings(self.framework, get_spec(POLICY_LOSS, self.policy_loss), settings, logger)
        return split_call_options(as_params(settings))

    def effective_estimator_params(self, logger: Any = None) -> dict:
        """The selected estimator's effective hyper-parameters, from :meth:`advantage_settings` (printed once)."""
        from .api import get_spec
        from .settings import as_params, log_effective_settings

        settings = self.advantage_settings()
        log_effective_settings(self.framework, get_spec(ADVANTAGE_ESTIMATOR, self.advantage_estimator), settings,
                               logger)
        return as_params(settings)

    def validate(self) -> "AlgorithmSelection":
        """Build the Params the workers will build (the effective ones) now, so a bad key or value fails before the
        framework starts: the loss's (and its call options), the estimator's (and a shaper next to reward
        components), then :meth:`check_extensions`. Parameters of the framework's own algorithm are refused."""
        from .api import get_spec
        from .call_options import check_call_options, split_call_options
        from .registry import get_framework
        from .resolve import check_shaper_and_components
        from .settings import as_params

        keys = get_framework(self.framework).selection_keys
        if self.policy_loss is not None:
            spec = get_spec(POLICY_LOSS, self.policy_loss)
            hyper, options = split_call_options(as_params(self.loss_settings()))
            build_params(spec, hyper)
            check_call_options(self.framework, spec, options, hyper)
        elif self.policy_loss_params:
            raise StableRLError(f"stablerl loss hyper-parameters given, but {keys[POLICY_LOSS]} is an {self.label} "
                                "built-in")
        if self.advantage_estimator is not None:
            spec = get_spec(ADVANTAGE_ESTIMATOR, self.advantage_estimator)
            build_params(spec, as_params(self.advantage_settings()))
            check_shaper_and_components(self.reward_shaper, spec, bool(self.reward_components), self.components_key)
        elif self.advantage_params:
            raise StableRLError(f"stablerl advantage hyper-parameters given, but {keys[ADVANTAGE_ESTIMATOR]} is an "
                                f"{self.label} built-in")
        elif self.reward_components:
            raise StableRLError(f"{self.components_key} given, but {keys[ADVANTAGE_ESTIMATOR]} is an {self.label} "
                                "built-in (only stablerl estimators read reward components)")
        self.check_extensions(keys.get, lambda kind: f"{keys[kind]}_params", self.components_key, self.weights_key)
        return self

    @classmethod
    def from_config(cls, config: Any, keys: Mapping[str, tuple], *, prefix: str = "",
                    **fields: Any) -> "AlgorithmSelection":
        """The selection a framework's config holds: ``keys``: kind -> (the key naming the algorithm, the key of its
        parameters), read with :func:`stablerl.selection.read_selection` (``prefix`` spells the keys in errors);
        unknown names and bad parameters raise naming the valid ones. ``fields``: the rest."""
        import functools

        from .selection import check_known, read_selection

        for kind, (key, params_key) in keys.items():
            attr, params_attr = FIELDS[kind]
            fields[attr], fields[params_attr] = read_selection(
                config, key, params_key, prefix=prefix, check=functools.partial(check_known, kind, prefix + key))
        return cls(**fields)

    @classmethod
    def from_values(cls, values: Mapping[str, tuple], **fields: Any) -> "AlgorithmSelection":
        """kind -> ``(name, raw parameters, where they were given)``: names resolved by core's one rule in
        :attr:`framework` (unknown ones raise saying why), parameters parsed (``k=v`` items or JSON;
        :func:`stablerl.params.parse_params`). ``fields``: the rest."""
        from .params import parse_params
        from .resolve import resolve

        for kind, (name, params, where) in values.items():
            attr, params_attr = FIELDS[kind]
            fields[attr], fields[params_attr] = resolve(cls.framework, kind, name), parse_params(params, where)
        return cls(**fields)

    @classmethod
    def from_env(cls, env: Mapping[str, str], variables: Mapping[str, tuple], given: Mapping[str, Any] = (),
                 **fields: Any) -> "AlgorithmSelection":
        """The selection an environment holds (a no-wrapper route): ``variables``: kind -> (the variable naming the
        algorithm, the one holding its parameters); ``given``: kind -> the name the framework's own config holds, used
        when the variable is unset (its parameters then come only with a name from the environment)."""
        given = dict(given)
        return cls.from_values({kind: (env.get(var) or given.get(kind),
                                       env.get(params_var) if env.get(var) or kind not in given else None, params_var)
                                for kind, (var, params_var) in variables.items()}, **fields)


__all__ = ["AlgorithmSelection", "FIELDS"]
