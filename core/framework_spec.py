"""The declaration of a framework, as its adapter makes it: :class:`FrameworkSpec` and :class:`FrameworkKey`.

An adapter declares a :class:`FrameworkSpec` through the ``register_frameworks`` hook (the built-in verl,
TRL and OpenRLHF declarations come through the same hook as a third party's); the registry collects them
(:func:`stablerl.registry.get_framework`). Building one imports no framework.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .contracts import OPTIONAL_INPUTS, AlgorithmSpec


@dataclass(frozen=True)
class FrameworkKey:
    """A framework config key that sets a stablerl hyper-parameter (e.g. verl's
    ``actor_rollout_ref.actor.clip_ratio_high``) and the framework's own default for it."""

    key: str
    default: Any = None
    # a value the user set for an algorithm without that hyper-parameter is refused, not ignored
    # (framework knobs that change advantages: TRL's scale_rewards, OpenRLHF's no_std_norm)
    refuse_if_unused: bool = False
    # how the framework spells a stablerl value, e.g. TRL's scale_rewards: {False: "'none'"}
    spelled: Optional[Mapping[Any, str]] = None

    def show(self, value: Any) -> str:
        spelled = (self.spelled or {}).get(value) if not isinstance(value, (list, dict)) else None
        return f"{self.key}={spelled if spelled is not None else value}"


@dataclass(frozen=True)
class FrameworkSpec:
    """One framework as its adapter declares it (no framework import needed to build it)."""

    name: str  # "verl", "trl", "openrlhf"
    distribution: str  # the pip distribution whose version is checked
    supported: str  # PEP 440 specifier of the versions the adapter supports, e.g. ">=0.9.1,<0.10"
    adapter: str  # import path of the adapter module; imported only by load_adapter()
    # "module:Class" of the adapter's FrameworkAdapter subclass (stablerl.adapter.get_adapter)
    adapter_class: str = ""
    # kind -> names the framework ships itself; a stablerl algorithm of the same name is prefix+name
    builtin_names: Mapping[str, frozenset] = field(default_factory=dict)
    # kind -> optional inputs (contracts.OPTIONAL_INPUTS) the adapter can feed to that kind
    feedable: Mapping[str, frozenset] = field(default_factory=dict)
    # kind (or "*" for every kind) -> input -> why the framework cannot feed it (shown on refusal)
    why_not: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # kind (or "*") -> input -> what the user must set for the framework to feed it (a feedable input that
    # exists only under a setting: an algorithm requiring it is "partial", not plain "selectable")
    conditions: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    # kind -> why the framework has no config key for that kind (shown instead of a bare "no config key")
    why_no_key: Mapping[str, str] = field(default_factory=dict)
    # kind -> the config key / flag that selects an algorithm of that kind
    selection_keys: Mapping[str, str] = field(default_factory=dict)
    # kind -> stablerl hyper-parameter name -> the framework key that also sets it, with the
    # framework's default (see effective_hyperparameters for the precedence)
    hyperparameter_keys: Mapping[str, Mapping[str, FrameworkKey]] = field(default_factory=dict)
    # kind -> how a user sets a stablerl hyper-parameter in this framework: a template with {name}
    # and {value}, e.g. "+actor_rollout_ref.actor.policy_loss.{name}={value}", or a function (name, value) -> str
    params_keys: Mapping[str, Any] = field(default_factory=dict)
    prefix: str = "stablerl_"
    # spec -> the config lines that select spec and set its hyper-parameters (docs, `stablerl describe`)
    config_lines: Optional[Callable[[AlgorithmSpec], list]] = None
    # how to install the adapter / run the framework with it (one line, for docs)
    usage: str = ""
    # named framework switches core's messages refer to, e.g. {"rollout_correction": "<the key that
    # turns the framework's own rollout-correction weights off>"}
    switches: Mapping[str, str] = field(default_factory=dict)
    # algorithm name -> what differs in this framework by the framework's own design (shown with its
    # config lines: `stablerl describe`, the generated docs, the parity matrix)
    algorithm_notes: Mapping[str, str] = field(default_factory=dict)

    def condition(self, kind: str, input_name: str) -> Optional[str]:
        """What the user must set for this framework to feed ``input_name`` to ``kind`` (None: always fed)."""
        return self.conditions.get(kind, {}).get(input_name) or self.conditions.get("*", {}).get(input_name)

    def with_config_lines(self, fn: Callable[[AlgorithmSpec], list]) -> "FrameworkSpec":
        from dataclasses import replace

        return replace(self, config_lines=fn)

    def why(self, kind: str, input_name: str) -> str:
        """Why this framework cannot feed ``input_name`` to an algorithm of ``kind``."""
        return (self.why_not.get(kind, {}).get(input_name) or self.why_not.get("*", {}).get(input_name)
                or OPTIONAL_INPUTS.get(input_name, "not provided"))
