"""The verl adapter's one patch ledger (``VerlAdapter().ledger``): every change it makes to verl (registry entries,
the wrapped call sites, the engine and trainer patches, the post-import hooks) is recorded there, and
``stablerl.adapters.verl.uninstrument()`` puts every original back (see :mod:`stablerl.patching`)."""

import logging

from stablerl.adapters.verl._adapter import VerlAdapter

LEDGER = VerlAdapter().ledger


def patch_ray_trainer_method(key: str, module, method: str, wrap, without: str) -> None:
    """Replace ``RayPPOTrainer.<method>`` of verl's trainer ``module`` by ``wrap(original)``, recorded under
    ``key``; a verl without that method gets a warning saying what is lost (``without``)."""
    cls = getattr(module, "RayPPOTrainer", None)
    if cls is None or not callable(getattr(cls, method, None)):
        logging.getLogger("stablerl.adapters.verl").warning(
            "stablerl: verl's %s has no RayPPOTrainer.%s; %s", module.__name__, method, without)
        return
    LEDGER.set_attr(key, cls, method, wrap(getattr(cls, method)))
