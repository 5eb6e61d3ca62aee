"""OpenRLHF's PPO/GRPO entry point with stablerl names: the same flags, plus stablerl algorithms.

    python -m stablerl.adapters.openrlhf.train_ppo_ray <your usual openrlhf.cli.train_ppo_ray flags> \\
        --actor.policy_loss_type m2po --actor.stablerl_params m2_threshold=0.04 \\
        --algo.advantage.estimator qae --algo.advantage.stablerl_params quantile_k=0.4

It runs OpenRLHF's own ``openrlhf.cli.train_ppo_ray`` as ``__main__``, whose parser, ``hierarchize`` and
``ray.init`` live in its ``__main__`` block (nothing to call or subclass), with core's script wrapper
(:mod:`stablerl.script_wrapper`: argparse, Ray and OpenRLHF are never patched): its ``import`` statements see
three modules with one name each replaced:

1. ``argparse.ArgumentParser``: the two name flags also accept stablerl names (argparse still rejects unknown
   ones, listing the valid ones), and the stablerl flags (parameters, shapers, filters, the entropy controller,
   routing replay) are added next to them (docs/openrlhf.md, "Flags");
2. ``openrlhf.utils.config.hierarchize``: also attaches ``args.stablerl`` (a validated :class:`Selection`, so a
   bad key fails before Ray starts; it reaches every model actor inside the pickled ``DeepspeedStrategy``);
3. ``ray.init``: adds stablerl's ``worker_process_setup_hook`` to OpenRLHF's ``runtime_env``; forwards
   ``STABLERL_ROUTING_REPLAY=R3`` (the vLLM workers get no ``args``) and, where the workers hand data back on
   tensor attributes (routing replay, the old-pass entropy), sets ``RAY_ENABLE_ZERO_COPY_TORCH_TENSORS=0``.
"""

from __future__ import annotations

import argparse
import functools
import os
import sys
import types
from typing import Any, Callable, Optional, Sequence

import stablerl
from stablerl.frameworks import get_framework
from stablerl.params import StableRLError
from stablerl.sampling_mask import log_replay_decision
from stablerl.script_wrapper import ModuleView, NameChoices, argparse_view, flag_given, name_flag_help, run_script

from . import _routing_replay
from ._flags import (ADV_FLAG, ADV_PARAMS_FLAG, COMPONENT_WEIGHTS_FLAG, COMPONENTS_FLAG, CONTROLLER_FLAG,
                     DUAL_CLIP_FLAG, ENV_ROUTING_REPLAY, EPS_CLIP_FLAG, EPS_CLIP_LOW_HIGH_FLAG, FILTER_FLAG, GAMMA_FLAG,
                     LOSS_FLAG, LOSS_PARAMS_FLAG, NAME, NO_STD_NORM_FLAG, REWARD_CLIP_FLAG, SAMPLING_REPLAY_FLAG,
                     SHAPER_FLAG, TEACHER_FLAG, check_openrlhf)
from ._sampling_mask import decide
from ._selection import (Selection, add_setup_hook, check_entropy_coef_unset, check_rollout_log_probs,
                         openrlhf_choices)
from ._versions import check_version_source


def _stablerl_flags(kind: str) -> list[tuple[str, dict]]:
    """The stablerl flags added after OpenRLHF's name flag of ``kind``: (flag, add_argument kwargs)."""

    def params(what: str) -> dict:
        return dict(type=str, nargs="+", default=None, metavar="KEY=VALUE",
                    help=f"stablerl {what} hyper-parameters, KEY=VALUE items (VALUE read as JSON) or one JSON object; "
                    "unset keys take the paper's defaults")

    if kind == stablerl.POLICY_LOSS:
        return [(LOSS_PARAMS_FLAG, params("loss")), (CONTROLLER_FLAG, dict(type=str, default=None, metavar="NAME", help=(
            "stablerl entropy controller, stepped once per optimizer step with its mean training entropy; it sets "
            f"--actor.entropy_coef every step (leave that unset): {', '.join(openrlhf_choices(stablerl.CONTROLLER))}"))),
            (CONTROLLER_FLAG + "_params", params("entropy controller")), (_routing_replay.FLAG, dict(
            type=lambda v: str(v).strip().upper(), choices=_routing_replay.MODES, default=None, metavar="{R2,R3}",
            help="stablerl MoE routing replay: R2 records the experts of the actor's old-log-prob pass, R3 takes "
            "the experts vLLM chose (vllm>=0.14); replayed in the old-log-prob pass (R3) and every training step"))]
    return [
        (ADV_PARAMS_FLAG, params("advantage estimator")),
        (COMPONENTS_FLAG, dict(type=str, nargs="+", default=None, metavar="KEY", help=(
            "the reward function's extra_logs keys (one value per response) that are reward components, handed to "
            "the stablerl estimator as reward_components (gdpo normalises each in its group)"))),
        (COMPONENT_WEIGHTS_FLAG, dict(type=float, nargs="+", default=None, metavar="W",
                                      help=f"weights of the {COMPONENTS_FLAG} (default 1 each)")),
        (SHAPER_FLAG, dict(type=str, default=None, metavar="NAME", help=(
            "stablerl reward shaper, applied on the per-response rewards, after OpenRLHF's length penalties and "
            f"before the estimator: {', '.join(openrlhf_choices(stablerl.REWARD_SHAPER))}"))),
        (SHAPER_FLAG + "_params", params("reward shaper")),
        (FILTER_FLAG, dict(type=str, default=None, metavar="NAME", help=(
            "stablerl batch filter, applied after the estimator; dropped rows get action_mask 0 (no loss, not "
            f"counted): {', '.join(openrlhf_choices(stablerl.BATCH_FILTER))}"))),
        (FILTER_FLAG + "_params", params("batch filter")),
        (TEACHER_FLAG, dict(type=str, default=None, metavar="PATH", help=(
            "on-policy distillation: the reference model loads this teacher checkpoint (the actor's tokenizer, "
            "checked) instead of the actor's; its log-probs feed --algo.advantage.estimator on_policy_distillation"))),
        (SAMPLING_REPLAY_FLAG, dict(type=str, default="auto", choices=("auto", "true", "false"), help=(
            "stablerl sampling-mask replay: express vLLM's top-p/top-k log-probs over the full vocabulary (the old-"
            "log-prob pass measures the trainer's mass on the kept set) before --algo.advantage.is_correction_level "
            "and any stablerl loss compare against them; auto: on when --rollout.top_p < 1 and rollout log-probs "
            "are collected"))),
    ]


def _extend_name_flag(run: "_ScriptRun", parser, add_argument: Callable[..., Any], args: tuple,
                      kwargs: dict) -> Optional[Any]:
    """``add_argument`` for OpenRLHF's two name flags, extended with stablerl's names and followed by the
    stablerl flags that belong to it; None for every other flag."""
    flags = set(a for a in args if isinstance(a, str))
    kind = stablerl.POLICY_LOSS if LOSS_FLAG in flags else stablerl.ADVANTAGE_ESTIMATOR if ADV_FLAG in flags else None
    if kind is None:
        return None
    framework = get_framework(NAME)
    kwargs["choices"] = NameChoices(framework, kind)
    kwargs["help"] = name_flag_help(framework, kind, kwargs.get("help"), "OpenRLHF")
    kwargs.setdefault("metavar", "NAME")
    action = add_argument(*args, **kwargs)
    for flag, flag_kwargs in _stablerl_flags(kind):
        add_argument(flag, **flag_kwargs)
    run.parser = parser
    return action


class _ScriptRun:
    """One run of OpenRLHF's CLI script with stablerl's views of argparse, ``hierarchize`` and Ray."""

    def __init__(self):
        self.parser: Optional[argparse.ArgumentParser] = None
        self.selection: Optional[Selection] = None

    def error(self, message: str):
        if self.parser is not None:
            self.parser.error(message)  # exits 2, like every argparse error
        raise SystemExit(f"error: {message}")

    def _config(self, module: types.ModuleType) -> types.ModuleType:
        def hierarchize(args):
            out = module.hierarchize(args)
            try:
                out.stablerl = selection_from_cli(out)
            except StableRLError as e:
                self.error(str(e))
            self.selection = out.stablerl
            if out.stablerl.routing_replay == "R3":  # add_setup_hook forwards it to the vLLM workers (no args there)
                os.environ[ENV_ROUTING_REPLAY] = "R3"
            return out

        return ModuleView(module, hierarchize=hierarchize)

    def _ray(self, module: types.ModuleType) -> types.ModuleType:
        def init(*args, **kwargs):
            kwargs["runtime_env"] = add_setup_hook(kwargs.get("runtime_env"), self.selection)
            return module.init(*args, **kwargs)

        return ModuleView(module, init=init)

    def views(self) -> dict:
        """What the script's ``import`` of argparse, OpenRLHF's config module and Ray returns."""
        return {"argparse": lambda module: argparse_view(module, functools.partial(_extend_name_flag, self)),
                "openrlhf.utils.config": self._config, "ray": self._ray}


def explicit_clip_flags(args, argv: Sequence[str]) -> dict:
    """The OpenRLHF clip flags the user gave, as stablerl clip fields (see Selection.openrlhf_clip)."""
    out = {}
    if flag_given(argv, EPS_CLIP_LOW_HIGH_FLAG) or flag_given(argv, EPS_CLIP_FLAG):
        low, high = args.actor.eps_clip_low_high or (args.actor.eps_clip, args.actor.eps_clip)
        out.update(clip_ratio_low=float(low), clip_ratio_high=float(high))
    if flag_given(argv, DUAL_CLIP_FLAG):
        out["clip_ratio_c"] = args.actor.dual_clip
    return out


def explicit_advantage_flags(args, argv: Sequence[str]) -> tuple[dict, Optional[tuple]]:
    """The OpenRLHF advantage knobs the user gave: ``--algo.advantage.no_std_norm`` as the stablerl
    ``norm_adv_by_std_in_grpo=False``, ``--algo.advantage.gamma`` as ``gamma`` (REINFORCE-family returns), and
    ``--reward.clip_range`` (None when not given)."""
    framework = {"norm_adv_by_std_in_grpo": False} if flag_given(argv, NO_STD_NORM_FLAG) else {}
    if flag_given(argv, GAMMA_FLAG) and float(args.algo.advantage.gamma) != 1.0:  # 1.0: the default
        framework["gamma"] = float(args.algo.advantage.gamma)
    clip_range = tuple(args.reward.clip_range) if flag_given(argv, REWARD_CLIP_FLAG) and args.reward.clip_range else None
    return framework, clip_range


def selection_from_cli(args) -> Selection:
    """``args.stablerl`` from OpenRLHF's hierarchized args (names resolved, params parsed and validated)."""
    actor, advantage, argv = args.actor, args.algo.advantage, sys.argv[1:]

    def flag(namespace, name: str):
        return getattr(namespace, name, None)

    sel = Selection.from_values(
        {stablerl.POLICY_LOSS: (actor.policy_loss_type, flag(actor, "stablerl_params"), LOSS_PARAMS_FLAG),
         stablerl.ADVANTAGE_ESTIMATOR: (advantage.estimator, flag(advantage, "stablerl_params"), ADV_PARAMS_FLAG),
         stablerl.REWARD_SHAPER: (flag(advantage, "stablerl_reward_shaper"),
                                  flag(advantage, "stablerl_reward_shaper_params"), SHAPER_FLAG + "_params"),
         stablerl.BATCH_FILTER: (flag(advantage, "stablerl_batch_filter"),
                                 flag(advantage, "stablerl_batch_filter_params"), FILTER_FLAG + "_params"),
         stablerl.CONTROLLER: (flag(actor, "stablerl_entropy_controller"),
                               flag(actor, "stablerl_entropy_controller_params"), CONTROLLER_FLAG + "_params")},
        reward_components=tuple(flag(advantage, "stablerl_reward_components") or ()),
        reward_weights=tuple(float(w) for w in flag(advantage, "stablerl_reward_weights") or ()),
        openrlhf_clip=explicit_clip_flags(args, argv),
        routing_replay=_routing_replay.check_mode(flag(actor, "stablerl_routing_replay"), args),
        sampling_replay=decide(args, flag(advantage, "sampling_mask_replay")),
    )
    log_replay_decision(sel.sampling_replay)
    sel.openrlhf_advantage, sel.reward_clip_range = explicit_advantage_flags(args, argv)
    sel.validate()  # the effective hyper-parameters, clip flags included
    check_entropy_coef_unset(sel.entropy_controller, actor)
    if sel.policy_loss is not None:
        spec = stablerl.get_spec(stablerl.POLICY_LOSS, sel.policy_loss)
        check_rollout_log_probs(spec, sel.policy_loss_params, advantage.is_correction_level)
        check_version_source(spec, args.train)
        if "index" in spec.requires:
            check_group_batching(sel.policy_loss, args)
    return sel


def check_group_batching(loss: str, args) -> None:
    """A loss that takes prompt groups needs whole groups per micro-batch (._groups): refuse, before Ray
    starts, the OpenRLHF batching that cannot give them."""
    n = int(args.rollout.n_samples_per_prompt)
    problems = []
    if getattr(args.train, "dynamic_batch_enable", False):
        problems.append("--train.dynamic_batch_enable partitions rows by length, not by prompt group")
    if n < 2:
        problems.append(f"--rollout.n_samples_per_prompt={n}: a group needs at least 2 responses")
    for flag, value in (("--train.micro_batch_size", getattr(args.train, "micro_batch_size", None)),
                        ("--rollout.micro_batch_size", getattr(args.rollout, "micro_batch_size", None))):
        if value is not None and n > 0 and int(value) % n:
            problems.append(f"{flag}={value} is not a multiple of --rollout.n_samples_per_prompt={n}")
    if problems:
        raise StableRLError(f"policy loss {loss!r} takes prompt groups (index) and needs whole groups in every "
                            "micro-batch: " + "; ".join(problems))


def _patch_driver() -> None:
    """On-policy distillation: OpenRLHF's ``train()`` builds its model groups in this (driver) process, where no Ray
    setup hook runs, so the launcher patch that lets the reference group load the teacher is applied here (through
    the adapter's ledger: once, undone by ``uninstrument()``)."""
    from openrlhf.trainer.ray import launcher

    from ._adapter import OpenRLHFAdapter
    from ._teacher import patch_launcher_module

    adapter = OpenRLHFAdapter()
    patch_launcher_module(launcher, adapter.ledger, adapter)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """Run ``openrlhf.cli.train_ppo_ray`` with stablerl names accepted (``argv``: its flags)."""
    check_openrlhf()
    _patch_driver()
    run_script("openrlhf.cli.train_ppo_ray", _ScriptRun().views(), argv, restore_env=(ENV_ROUTING_REPLAY,))


if __name__ == "__main__":
    main()
