"""The verl adapter's instance and its one patch ledger, for the call-site modules.

Every change the adapter makes to verl (registry entries, the wrapped call sites, the engine and trainer patches, the
post-import hooks) is recorded in ``VerlAdapter().ledger``, and ``stablerl.adapters.verl.uninstrument()`` puts every
original back (see :mod:`stablerl.patching`). The call-site modules reach the instance through core's
:func:`~stablerl.adapter.get_adapter`, never by importing ``_adapter`` (which imports them: no import cycle)."""

import logging
from typing import Any, Callable, Optional

from stablerl.adapter import get_adapter

logger = logging.getLogger("stablerl.adapters.verl")


def verl_adapter():
    """The verl adapter (one instance per process): its state, ledger and providers."""
    return get_adapter("verl")


LEDGER = verl_adapter().ledger


def patch_ray_trainer_method(key: str, module, method: str, wrap, without: str) -> None:
    """Replace ``RayPPOTrainer.<method>`` of verl's trainer ``module`` by ``wrap(original)``, recorded under
    ``key``; a verl without that method gets a warning saying what is lost (``without``)."""
    cls = getattr(module, "RayPPOTrainer", None)
    if cls is None or not callable(getattr(cls, method, None)):
        logger.warning(
            "stablerl: verl's %s has no RayPPOTrainer.%s; %s", module.__name__, method, without)
        return
    LEDGER.set_attr(key, cls, method, wrap(getattr(cls, method)))


def guarded(patch: Callable[[Any], None], lost: str, errors: Optional[dict] = None) -> Callable[[Any], None]:
    """``patch(module)`` for a post-import hook, which must not break verl's own import: a failure is logged at ERROR
    saying what is ``lost`` (and kept as ``errors["error"]`` for the adapter's status and its refusals)."""

    def apply(module) -> None:
        try:
            patch(module)
        except Exception as e:  # noqa: BLE001
            error = f"{type(e).__name__}: {e}"
            if errors is not None:
                errors["error"] = error
            logger.error("stablerl: the verl patch of %s failed (%s): %s", module.__name__, lost, error)

    return apply
