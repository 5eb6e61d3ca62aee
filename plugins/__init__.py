"""Built-in stablerl plugins: one module per algorithm or family.

They register through the same hooks as third-party plugins (see ``stablerl.hookspecs``).
Every module of this package is a built-in plugin; nothing else makes them special.
"""

import pkgutil as _pkgutil

BUILTIN_PLUGINS = tuple(
    f"{__name__}.{m.name}" for m in sorted(_pkgutil.iter_modules(__path__), key=lambda m: m.name) if not m.name.startswith("_")
)
