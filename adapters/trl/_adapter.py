"""The TRL adapter class: what TRL can feed (its providers), the version and signature check. Framework-free at
import (``stablerl list`` builds TRL's declaration from :meth:`TRLAdapter.feedable` where TRL is not installed).

The adapter extends TRL by subclassing (``stablerl.adapters.trl.GRPOTrainer``): :meth:`TRLAdapter._instrument`
patches nothing of TRL's, it checks the installed TRL. What one trainer rebinds on its own objects (``loss_type``
while TRL's loss runs as the host of a stablerl loss, ``model.forward`` for the fused head's ``log_sum_sq_probs``)
goes through that trainer's :class:`~stablerl.patching.PatchLedger`.

Each provider (``_providers``: ``LossInputs``, ``GenerationInputs``) reads one input from a batch's record: a
:class:`~stablerl.adapters.trl._records.GenerationBatch` (the advantage step's, gathered over processes) or a
:class:`~stablerl.adapters.trl._records.LossBatch` (one micro-batch of ``_compute_loss``).
"""

from __future__ import annotations

import os
from typing import Any

from stablerl.adapter import FrameworkAdapter
from stablerl.frameworks import UnsupportedVersionError, check_signatures, check_version
from stablerl.patching import PatchLedger

from ._providers import (BEHAVIOUR_LOG_PROBS, SYNCHRONOUS_VERSIONS, USER_INPUTS, VERSION_KEY,  # noqa: F401 (re-export)
                         GenerationInputs, LossInputs)


class UnsupportedTRLVersionError(UnsupportedVersionError):
    """The installed TRL is outside the range this adapter was written and tested against."""


# Private TRL methods this adapter overrides or calls, with the parameters it relies on.
REQUIRED_SIGNATURES = {
    "_compute_loss": ("model", "inputs"), "_generate_and_score_completions": ("inputs",), "_generate": ("prompts",),
    "_calculate_rewards": ("inputs", "prompts", "completions", "completion_ids_list"),
    "_get_per_token_logps_and_entropies": ("model", "input_ids", "attention_mask", "logits_to_keep", "compute_entropy",
                                           "compute_aux_loss"),
    "get_high_entropy_mask": ("entropies", "mask", "threshold"),
    "get_off_policy_mask": ("advantages", "per_token_logps", "sampling_per_token_logps", "mask", "off_policy_threshold"),
    "_generate_single_turn": ("prompt_ids", "images", "multimodal_fields", "num_generations", "has_tool_images"),
    "training_step": ("model", "inputs", "num_items_in_batch"),
    "compute_loss": ("model", "inputs", "return_outputs", "num_items_in_batch"),
    "_load_optimizer_and_scheduler": ("checkpoint",),  # stablerl state in TRL's checkpoints
}


class TRLAdapter(LossInputs, GenerationInputs, FrameworkAdapter):
    """TRL >= 1.16, < 1.17: ``GRPOTrainer`` / ``GRPOConfig`` subclasses (``stablerl.adapters.trl``)."""

    name = "trl"
    version_error = UnsupportedTRLVersionError

    # -- instrument: the version and the private signatures (nothing of TRL's is patched) --------------

    def check_dependencies(self, found=None, *, allow=None) -> str:
        if allow is None and os.environ.get("STABLERL_TRL_SKIP_VERSION_CHECK", "") == "1":
            allow = True  # the older spelling of STABLERL_ALLOW_UNSUPPORTED=1
        return super().check_dependencies(found, allow=allow)

    def check(self, trl_module=None) -> None:
        """Raise :class:`UnsupportedTRLVersionError` unless ``trl_module`` (default: TRL) is in the supported range
        (core's one version policy) and the private methods this adapter uses have the expected signatures (never
        waived)."""
        if trl_module is None:
            import trl as trl_module
        found = self.check_dependencies(getattr(trl_module, "__version__", "unknown"))
        check_signatures("trl", trl_module.GRPOTrainer, REQUIRED_SIGNATURES, found, error=UnsupportedTRLVersionError)

    def _instrument(self, ledger: PatchLedger, **options: Any) -> None:
        import trl

        check_signatures("trl", trl.GRPOTrainer, REQUIRED_SIGNATURES, self.version, error=UnsupportedTRLVersionError)


__all__ = ["TRLAdapter", "UnsupportedTRLVersionError", "REQUIRED_SIGNATURES", "USER_INPUTS", "VERSION_KEY",
           "BEHAVIOUR_LOG_PROBS"]
