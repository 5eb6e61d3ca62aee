"""Whole prompt groups for stablerl policy losses that take ``index`` (``gtpo``, ``pacs``, ``gvpo``, ``rebel``) in
verl 0.9.1.

Such a loss takes per-group quantities over the responses of one loss call, so every ``ppo_loss`` call must hold
whole groups. In verl's legacy trainer (``trainer.use_v1=false``) the batch leaves generation with each prompt's
``rollout.n`` responses contiguous; then

* ``RayPPOTrainer._balance_batch`` (``trainer.balance_batch=true``, verl's default) reorders single rows over the DP
  ranks: the adapter's wrap deals out whole groups instead (core's
  :func:`~stablerl.frameworks.balanced_group_partitions`, balancing verl's own workloads; verl's ``global_seqlen/*``
  metrics unchanged in meaning);
* verl hands each DP rank a contiguous chunk, the worker cuts it into contiguous mini-batches of
  ``ppo_mini_batch_size * rollout.n / dp`` rows (``actor.shuffle=false``) and those into contiguous micro-batches of
  ``ppo_micro_batch_size_per_gpu`` rows (no ``use_dynamic_bsz``): whole groups when ``data.train_batch_size`` and
  ``ppo_mini_batch_size`` are multiples of the DP size and ``ppo_micro_batch_size_per_gpu`` of ``rollout.n``.

:func:`check_config` refuses, in the driver when verl validates its config (``verl.utils.config.validate_config``,
before Ray starts), the settings under which that cannot hold, naming the keys to change; :func:`check_loss_call`
refuses a split group at the loss call site (``ppo_loss``), so a split group is never silently used, and counts the
groups of the call (``actor/stablerl/prompt_groups``). verl's v1 trainer (``trainer.use_v1=true``) pads its batch with
synthetic rows and balances single rows in TransferQueue metadata; it is refused with these losses.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Optional

import numpy as np
import torch

from stablerl import POLICY_LOSS, get_spec
from stablerl.adapters.verl._ledger import LEDGER, patch_ray_trainer_method, verl_adapter
from stablerl.adapters.verl._providers import WHOLE_GROUPS
from stablerl.frameworks import balanced_group_partitions, check_whole_groups
from stablerl.params import StableRLError
from stablerl.selection import config_get

logger = logging.getLogger("stablerl.adapters.verl")

_ACTOR = "actor_rollout_ref.actor."
PATCH_KEY = "groups"
TRAINER_MODULE = "verl.trainer.ppo.ray_trainer"
CONFIG_MODULE = "verl.utils.config"
#: modules that bind ``validate_config`` at import time
CONFIG_CALLERS = ("verl.trainer.main_ppo",)
METRIC = "actor/stablerl/prompt_groups"


def group_loss(config: Any) -> Optional[str]:
    """The stablerl policy loss selected in verl's full config (``actor_rollout_ref.actor.policy_loss.loss_mode``)
    when it takes prompt groups (declares ``index``), else None."""
    actor = config_get(config_get(config, "actor_rollout_ref"), "actor")
    return loss_taking_groups(config_get(config_get(actor, "policy_loss"), "loss_mode", "vanilla"))


def loss_taking_groups(loss_mode: Any) -> Optional[str]:
    name = verl_adapter().stablerl_name(POLICY_LOSS, loss_mode)
    return name if name is not None and "index" in get_spec(POLICY_LOSS, name).requires else None


def _dp_size(config: Any, actor: Any) -> int:
    trainer = config_get(config, "trainer")
    n_gpus = int(config_get(trainer, "n_gpus_per_node", 1) or 1) * int(config_get(trainer, "nnodes", 1) or 1)
    if config_get(actor, "strategy") == "megatron":
        mg = config_get(actor, "megatron")
        parallel = 1
        for key in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "context_parallel_size"):
            parallel *= int(config_get(mg, key, 1) or 1)
    else:
        parallel = int(config_get(actor, "ulysses_sequence_parallel_size", 1) or 1)
    return max(1, n_gpus // max(1, parallel))


def check_config(config: Any) -> Optional[str]:
    """Refuse verl settings under which a loss call of the selected group loss could hold a split group (every
    problem at once, each with the key to change); returns the loss's name (None: the loss takes no groups)."""
    name = group_loss(config)
    if name is None:
        return None
    actor_rollout_ref = config_get(config, "actor_rollout_ref")
    actor, rollout = config_get(actor_rollout_ref, "actor"), config_get(actor_rollout_ref, "rollout")
    n = int(config_get(rollout, "n", 1) or 1)
    dp = _dp_size(config, actor)
    problems = []
    if config_get(config_get(config, "trainer"), "use_v1", False):
        problems.append("trainer.use_v1=true: the v1 trainer pads its batch with synthetic rows and balances single "
                        "rows over the DP ranks (set trainer.use_v1=false: the legacy trainer, whose balance_batch "
                        "the adapter makes deal out whole groups)")
    if config_get(actor, "use_dynamic_bsz", False):
        problems.append(f"{_ACTOR}use_dynamic_bsz=true cuts micro-batches by token count, not by prompt group (set it "
                        f"to false and {_ACTOR}ppo_micro_batch_size_per_gpu to a multiple of rollout.n={n})")
    else:
        micro = config_get(actor, "ppo_micro_batch_size_per_gpu")
        if micro is not None and int(micro) % n:
            problems.append(f"{_ACTOR}ppo_micro_batch_size_per_gpu={micro} is not a multiple of "
                            f"actor_rollout_ref.rollout.n={n}")
    if config_get(actor, "shuffle", False):
        problems.append(f"{_ACTOR}shuffle=true shuffles single rows within each mini-batch (set it to false)")
    train_batch = config_get(config_get(config, "data"), "train_batch_size")
    if train_batch is not None and int(train_batch) % dp:
        problems.append(f"data.train_batch_size={train_batch} prompts is not a multiple of the {dp} data-parallel "
                        "ranks: verl hands each rank an equal chunk of rows")
    mini = config_get(actor, "ppo_mini_batch_size")
    if mini is not None and int(mini) % dp:
        problems.append(f"{_ACTOR}ppo_mini_batch_size={mini} prompts is not a multiple of the {dp} data-parallel "
                        "ranks: each rank's mini-batch would end inside a group")
    if n < 2:
        problems.append(f"actor_rollout_ref.rollout.n={n}: a prompt group needs at least 2 responses")
    if problems:
        raise StableRLError(
            f"stablerl policy loss {name!r} takes prompt groups (index) and needs whole groups in every loss call; "
            "in verl: " + "; ".join(problems))
    return name


def check_loss_call(name: str, config: Any, index: Any) -> int:
    """At ``ppo_loss``: raise unless every group in this call's ``index`` (verl's uids) has all of its
    ``config.rollout_n`` responses here; returns the number of groups."""
    n = int(config_get(config, "rollout_n", 0) or 0)
    if isinstance(index, torch.Tensor):
        ids = index.reshape(-1).long().cpu()
    else:
        _, inverse = np.unique(np.asarray(list(index), dtype=object).astype(str), return_inverse=True)
        ids = torch.as_tensor(inverse.reshape(-1), dtype=torch.long)
    if n < 1:
        raise StableRLError(f"stablerl policy loss {name!r} takes prompt groups, but verl's actor config has no "
                            "rollout_n (the group size)")
    try:
        why = f"this verl loss call holds {ids.numel()} rows; verl keeps groups whole with {WHOLE_GROUPS}"
        check_whole_groups(ids, torch.full_like(ids, n), why=why)
    except StableRLError as e:
        raise StableRLError(f"stablerl loss {name!r}: {e}") from None
    return int(torch.unique(ids).numel())


# ----------------------------------------------------------------------------- patching


def _wrap_validate_config(original):
    @functools.wraps(original)
    def validate_config(config, *args, **kwargs):
        check_config(config)  # first: the refusal names every key to change, before verl's own checks
        return original(config, *args, **kwargs)

    return validate_config


def _wrap_balance_batch(original):
    @functools.wraps(original)
    def _balance_batch(self, batch, metrics, logging_prefix="global_seqlen", keep_minibatch=False):
        uid = batch.non_tensor_batch.get("uid") if hasattr(batch, "non_tensor_batch") else None
        if uid is None or group_loss(getattr(self, "config", None)) is None:
            return original(self, batch, metrics, logging_prefix=logging_prefix, keep_minibatch=keep_minibatch)
        from verl.utils.seqlen_balancing import calculate_workload, log_seqlen_unbalance

        attention_mask = batch.batch["attention_mask"]
        seqlen = attention_mask.view(attention_mask.shape[0], -1).sum(-1)
        workload = calculate_workload(seqlen)
        dp_size = self._get_dp_size(self.actor_rollout_wg, "actor")
        partitions = balanced_group_partitions(
            [str(u) for u in uid], [float(w) for w in workload], dp_size, balance_key="trainer.balance_batch=true",
            group_size_key="actor_rollout_ref.rollout.n")
        batch.reorder(torch.tensor([i for part in partitions for i in part]))
        metrics.update(log_seqlen_unbalance(seqlen_list=seqlen.tolist(), partitions=partitions, prefix=logging_prefix))
        return None

    return _balance_batch


def _patch_trainer(module) -> None:
    patch_ray_trainer_method(f"{PATCH_KEY}:_balance_batch", module, "_balance_batch", _wrap_balance_batch,
                             "trainer.balance_batch=true splits prompt groups (a group loss is refused at its call)")


def instrument() -> None:
    """Wrap ``verl.utils.config.validate_config`` (the start-up refusal) and the legacy ``RayPPOTrainer._balance_batch``
    (whole groups over the DP ranks), now or when verl imports them. Idempotent."""
    LEDGER.wrap_function(f"{PATCH_KEY}:validate_config", CONFIG_MODULE, "validate_config", _wrap_validate_config,
                         CONFIG_CALLERS)
    LEDGER.on_import(f"{PATCH_KEY}:balance_batch", {TRAINER_MODULE: _patch_trainer})


def status() -> str:
    return "patched" if f"{PATCH_KEY}:_balance_batch" in LEDGER.keys() else "deferred"


__all__ = ["WHOLE_GROUPS", "METRIC", "check_config", "check_loss_call", "group_loss", "instrument", "status"]
