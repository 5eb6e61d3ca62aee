"""``python -m stablerl.adapters.skyrl.main <SkyRL's usual overrides>``: SkyRL's ``main_base`` with stablerl.

It parses the overrides with :func:`~stablerl.adapters.skyrl._config.config_class` (SkyRL's config plus the stablerl
keys of ``trainer.algorithm``; ``+trainer.algorithm.stablerl_*`` is taken as well), registers every stablerl loss and
estimator in SkyRL's registries before Ray starts, refuses a selection SkyRL cannot run (with the reason), prints
the effective-settings table, then runs SkyRL's own ``initialize_ray`` and experiment with
:class:`~stablerl.adapters.skyrl._trainer.StableRayPPOTrainer`. Also reachable from SkyRL's own entry point with
``trainer.override_entrypoint=stablerl.adapters.skyrl.main``.
"""

from __future__ import annotations

import sys
from typing import Any, Optional

import stablerl
from stablerl.contracts import ADVANTAGE_ESTIMATOR, BATCH_FILTER, POLICY_LOSS, REWARD_SHAPER
from stablerl.frameworks import check_call_options, log_effective_settings, resolve, split_call_options
from stablerl.frameworks import as_params as settings_params
from stablerl.params import build_params
from stablerl.teacher import check_same_vocabulary_of

from ._adapter import TEACHER, WHOLE_GROUPS, SkyRLAdapter
from ._config import config_class, loss_agg_mode, params, selected, selection, settings, strip_plus
from ._names import ADV_KEY, ALGORITHM, FILTER, LOSS_KEY, NAME, SHAPER

_KEYS = {POLICY_LOSS: LOSS_KEY, ADVANTAGE_ESTIMATOR: ADV_KEY, REWARD_SHAPER: ALGORITHM + SHAPER,
         BATCH_FILTER: ALGORITHM + FILTER}


def check(cfg: Any) -> None:
    """Refuse, before Ray starts, a stablerl selection SkyRL cannot run, and print the effective settings."""
    algorithm = cfg.trainer.algorithm
    for kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR, REWARD_SHAPER, BATCH_FILTER):
        raw = getattr(algorithm, _KEYS[kind][len(ALGORITHM):], None)
        name = resolve(NAME, kind, raw)  # unknown names, refused inputs: the error names the reason
        if name is None:
            if kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR) and params(algorithm, kind):
                raise stablerl.StableRLError(f"{NAME}: stablerl params given for SkyRL's own {kind.replace('_', ' ')}")
            continue
        if kind in (POLICY_LOSS, ADVANTAGE_ESTIMATOR):
            spec, effective = settings(algorithm, kind)
            hyper, options = split_call_options(settings_params(effective))
            build_params(spec, hyper)
            if kind == POLICY_LOSS:
                loss_agg_mode(algorithm, options)
                check_call_options(NAME, spec, options, hyper)
            log_effective_settings(NAME, spec, effective)
        else:
            build_params(stablerl.get_spec(kind, name), params(algorithm, kind))
    sel = selection(algorithm)
    if sel.requires(ADVANTAGE_ESTIMATOR, "teacher_log_prob"):
        ref, policy = cfg.trainer.ref.model.path, cfg.trainer.policy.model.path
        if not algorithm.use_kl_loss or algorithm.use_kl_in_reward or ref in (None, policy):
            raise stablerl.StableRLError(f"{NAME}: on-policy distillation reads the teacher's log-probs from SkyRL's "
                                         f"reference model: set {TEACHER}")
        check_same_vocabulary_of(f"trainer.ref.model.path={ref}", policy, ref)
    if sel.requires(POLICY_LOSS, "index") and (cfg.trainer.max_tokens_per_microbatch > 0 or
                                               cfg.trainer.micro_train_batch_size_per_gpu % cfg.generator.n_samples_per_prompt):
        raise stablerl.StableRLError(f"{NAME}: policy loss {sel.policy_loss!r} takes whole prompt groups: set {WHOLE_GROUPS}")
    # the entry point's trainer takes SkyRL's advantage pre-scaling over (the loss checks this flag)
    algorithm.stablerl_reduction = selected(algorithm, POLICY_LOSS) is not None
    if algorithm.stablerl_reduction:
        if cfg.generator.step_wise_trajectories:
            raise stablerl.StableRLError(
                f"{NAME}: a stablerl policy loss with generator.step_wise_trajectories=true is refused: a mini-batch "
                "then holds a varying number of rows (steps), and a loss that averages over sequences needs that count")
        algorithm.stablerl_mini_batch_rows = cfg.trainer.policy_mini_batch_size * cfg.generator.n_samples_per_prompt


def experiment_class():
    """SkyRL's ``BasePPOExp`` whose trainer is :class:`StableRayPPOTrainer`."""
    from skyrl.train.entrypoints.main_base import BasePPOExp

    from ._trainer import StableRayPPOTrainer

    class StableSkyRLExp(BasePPOExp):
        def get_trainer(self, cfg, tracker, tokenizer, train_dataset, eval_dataset, inference_engine_client,
                        generator, colocate_pg):
            return StableRayPPOTrainer(cfg=cfg, tracker=tracker, tokenizer=tokenizer, train_dataset=train_dataset,
                                       eval_dataset=eval_dataset, inference_engine_client=inference_engine_client,
                                       generator=generator, colocate_pg=colocate_pg)

    return StableSkyRLExp


def _run_experiment(cfg: Any, exp_class: Any) -> None:
    SkyRLAdapter().instrument(register=False)  # this process's workers' checkpoints (the registries come from Ray's actor)
    (exp_class or experiment_class())(cfg).run()


def run(cfg: Any, exp_class: Optional[type] = None) -> None:
    """Register, check, then SkyRL's ``initialize_ray`` and the experiment in a Ray task (as SkyRL's main does);
    ``exp_class``: a ``BasePPOExp`` subclass whose ``get_trainer`` builds a ``StableRayPPOTrainer``."""
    import ray
    from skyrl.train.utils import validate_cfg
    from skyrl.train.utils.utils import initialize_ray

    SkyRLAdapter().instrument()
    check(cfg)
    validate_cfg(cfg)
    initialize_ray(cfg)
    ray.get(ray.remote(num_cpus=1)(_run_experiment).remote(cfg, exp_class))


def main(argv: Optional[list] = None, exp_class: Optional[type] = None) -> None:
    argv = strip_plus(list(sys.argv[1:] if argv is None else argv))
    argv = [a for a in argv if not a.startswith("trainer.override_entrypoint=")]
    run(config_class().from_cli_overrides(argv), exp_class)


if __name__ == "__main__":
    main()
