"""Tools that need a framework: ``stablerl demo`` (:mod:`stablerl.tools.demo`) and ``stablerl bench``
(:mod:`stablerl.tools.bench`).

They sit above the adapters, not in the framework-free core: they load an adapter by name
(``load_adapter("trl")``), which nothing else under ``stablerl`` does. Nothing in core imports this
package except the CLI's ``demo`` and ``bench`` commands, at the call.
"""
