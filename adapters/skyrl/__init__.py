"""stablerl in SkyRL 0.3 (docs/skyrl.md): :func:`instrument` (:class:`SkyRLAdapter`) registers every stablerl policy
loss and advantage estimator SkyRL can feed in its registries (``stablerl_<name>`` where SkyRL owns the name);
``python -m stablerl.adapters.skyrl.main <SkyRL overrides>`` (``main``) trains with them. Importing this package
imports no SkyRL module.
"""

from __future__ import annotations

from ._adapter import SkyRLAdapter  # noqa: F401
from ._names import (NAME, PREFIX, SKYRL_ADV_ESTIMATORS, SKYRL_POLICY_LOSSES, SUPPORTED_SKYRL,  # noqa: F401
                     UnsupportedSkyRLVersionError, skyrl_names)


def instrument(**options) -> bool:
    """``SkyRLAdapter().instrument()``: register the stablerl algorithms in SkyRL's registries (in the driver, before
    Ray starts: ``initialize_ray`` shares them with every worker)."""
    return SkyRLAdapter().instrument(**options)


def uninstrument() -> bool:
    """``SkyRLAdapter().uninstrument()``: SkyRL's registries and workers as they were (a registry actor already
    synced keeps its copies until Ray shuts down)."""
    return SkyRLAdapter().uninstrument()
