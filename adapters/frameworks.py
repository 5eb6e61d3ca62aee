"""The built-in framework declarations (verl, TRL, OpenRLHF, SkyRL): stablerl's ``register_frameworks`` plugin.

Core reaches the built-in declarations only through the plugin manager (entry-point group ``stablerl.builtin``), the
way a third party would declare a fourth framework. Each framework's declaration lives with its adapter
(``adapters/<fw>/_spec.py``), where what the framework can feed is derived from the adapter's providers; importing
a declaration imports no framework. They are imported inside the hook, when the registry is first built, so that
importing this module stays free of side effects (verl's package instruments when verl itself is being imported).
"""

from __future__ import annotations

from stablerl.hookspecs import hookimpl


@hookimpl
def register_frameworks(register):
    from stablerl.adapters.openrlhf._spec import OPENRLHF
    from stablerl.adapters.skyrl._spec import SKYRL
    from stablerl.adapters.trl._spec import TRL
    from stablerl.adapters.verl._spec import VERL

    for framework in (VERL, TRL, OPENRLHF, SKYRL):
        register(framework)
