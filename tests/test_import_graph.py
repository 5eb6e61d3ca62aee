"""The import arrows point one way (issue 14, item 6), read from the source with ``ast`` (nothing is imported):

* no import cycle among the modules of ``adapters/`` (imports inside functions count: they close a cycle
  at run time just the same);
* no submodule of an adapter package imports its package's ``__init__`` (what submodules share lives in
  a private module);
* no adapter imports another adapter;
* core (``stablerl`` outside ``stablerl.plugins`` / ``stablerl.adapters``) imports neither by name; the tools
  package ``stablerl.tools`` (demo, bench), which drives a framework, may import adapters;
* plugins are leaves (issue 26, item 5): no module of ``plugins/`` imports another plugin module or the
  ``stablerl.plugins`` package (imports inside functions count); what two plugins share lives in core
  (``stablerl.primitives``), and an algorithm built on another calls it through the registry.
* no import cycle in core (issue 26, item 6), imports inside functions included. Imports of
  ``stablerl.plugins`` are not edges: core imports no plugin by name (the rule above), the plugin manager loads
  the built-ins through their entry points when the registry is first built (``stablerl.registry``), and a
  plugin importing core is the arrow pointing the right way;
* core names no framework: no ``load_adapter("<literal>")`` outside ``stablerl.tools``, and only the CLI
  (its ``demo`` / ``bench`` commands) imports ``stablerl.tools``.

``python tests/test_import_graph.py`` prints every violation.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: import package -> source folder (pyproject's package-dir)
PACKAGES = {"stablerl": ROOT / "core", "stablerl.plugins": ROOT / "plugins", "stablerl.adapters": ROOT / "adapters"}
ADAPTERS = "stablerl.adapters"
PLUGINS = "stablerl.plugins"
#: the tools that drive a framework (``stablerl demo``, ``stablerl bench``): may import adapters and name a framework
TOOLS = "stablerl.tools"
#: the one core module that imports the tools (its ``demo`` and ``bench`` commands)
TOOLS_IMPORTED_BY = {"stablerl.cli"}

#: core modules that still import adapters by name; the core side of item 6 removes them (the test fails
#: when one is added, and when one listed here no longer does, so the list only shrinks)
KNOWN_CORE_IMPORTS: set = set()  # core reaches adapters only through stablerl.frameworks.load_adapter


def modules() -> dict[str, Path]:
    """Every module of the three packages: dotted name -> file (a package is its ``__init__.py``)."""
    out: dict[str, Path] = {}
    for package, folder in PACKAGES.items():
        for path in folder.rglob("*.py"):
            parts = list(path.relative_to(folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            name = ".".join([package, *parts])
            # a file under core/ whose dotted path is another package's (none today) belongs to that package
            if package == "stablerl" and name.startswith(("stablerl.plugins", "stablerl.adapters")):
                continue
            out[name] = path
    return out


def imports_of(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of ``known`` that module ``name`` imports (``from pkg import sub`` counts as ``pkg.sub``
    when that is a module, else as ``pkg``; ``importlib.import_module("literal")`` counts too)."""
    is_package = path.name == "__init__.py"
    package = name if is_package else name.rpartition(".")[0]
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            subs = [f"{source}.{alias.name}" for alias in node.names]
            targets = [s for s in subs if s in known] or [source]
            if len(targets) < len(subs) and source not in targets:
                targets.append(source)  # names taken from the package itself besides its submodules
        elif (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "import_module"
              and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            targets = [node.args[0].value]
        for target in targets:
            while target and target not in known:  # `import a.b.c` of a module-less name: its nearest module
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def graph() -> dict[str, set[str]]:
    mods = modules()
    known = set(mods)
    return {name: imports_of(name, path, known) for name, path in mods.items()}


def load_adapter_literals(path: Path) -> list[int]:
    """Lines of ``path`` that call ``load_adapter("<literal>")`` (or ``<module>.load_adapter("<literal>")``):
    code that names a framework."""
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if (isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "load_adapter"
                and node.args and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)):
            out.append(node.lineno)
    return sorted(out)


def core_names_a_framework() -> list[tuple[str, int]]:
    """``(module, line)`` of every ``load_adapter("<literal>")`` in core outside the tools."""
    return [(name, line) for name, path in sorted(modules().items()) if in_core(name) and not _under(name, TOOLS)
            for line in load_adapter_literals(path)]


def _adapter_package(name: str) -> str | None:
    """``stablerl.adapters.verl`` for any module of that adapter package, else None."""
    parts = name.split(".")
    if name.startswith(ADAPTERS + ".") and len(parts) >= 3:
        candidate = ".".join(parts[:3])
        if (PACKAGES[ADAPTERS] / parts[2] / "__init__.py").exists():
            return candidate
    return None


def _is_plugin(name: str) -> bool:
    """A module of ``plugins/`` (the package itself included)."""
    return name == PLUGINS or name.startswith(PLUGINS + ".")


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def in_core(name: str) -> bool:
    """A module of core: ``stablerl`` outside ``stablerl.plugins`` and ``stablerl.adapters`` (the tools included)."""
    return _under(name, "stablerl") and not _under(name, PLUGINS) and not _under(name, ADAPTERS)


def cycles(edges: dict[str, set[str]], within: str) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), among the modules under ``within``
    (``"stablerl"``: among core's, :func:`in_core`; an import of another room is no edge here)."""
    nodes = [n for n in edges if (in_core(n) if within == "stablerl" else _under(n, within))]
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in nodes:
                continue
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in nodes:
        if v not in index:
            visit(v)
    return found


def violations(edges: dict[str, set[str]]) -> dict[str, list]:
    out: dict[str, list] = {"cycles": cycles(edges, ADAPTERS), "core_cycles": cycles(edges, "stablerl"),
                            "imports_own_package": [], "adapter_imports_adapter": [], "core_imports_by_name": [],
                            "core_imports_tools": [], "plugin_imports_plugin": []}
    for name, targets in sorted(edges.items()):
        own = _adapter_package(name)
        for target in sorted(targets):
            if own is not None and name != own and target == own:
                out["imports_own_package"].append((name, target))
            other = _adapter_package(target)
            if own is not None and other is not None and other != own:
                out["adapter_imports_adapter"].append((name, target))
            if in_core(name) and (_under(target, PLUGINS) or (_under(target, ADAPTERS) and not _under(name, TOOLS))):
                out["core_imports_by_name"].append((name, target))
            if _is_plugin(name) and name != PLUGINS and _is_plugin(target):
                out["plugin_imports_plugin"].append((name, target))
            if (in_core(name) and not _under(name, TOOLS) and name not in TOOLS_IMPORTED_BY
                    and _under(target, TOOLS)):
                out["core_imports_tools"].append((name, target))
    return out


# ----------------------------------------------------------------------------- tests


def test_the_checker_sees_a_cycle_and_a_package_import(tmp_path):
    """The rules can fail: a made-up adapter package with both faults is caught."""
    edges = {
        "stablerl.adapters.fake": {"stablerl.adapters.fake._a"},
        "stablerl.adapters.fake._a": {"stablerl.adapters.fake._b"},
        "stablerl.adapters.fake._b": {"stablerl.adapters.fake._a", "stablerl.adapters.fake"},
    }
    assert cycles(edges, ADAPTERS) == [["stablerl.adapters.fake", "stablerl.adapters.fake._a",
                                        "stablerl.adapters.fake._b"]]
    assert (PACKAGES[ADAPTERS] / "verl" / "__init__.py").exists()
    edges = {"stablerl.adapters.verl._x": {"stablerl.adapters.verl", "stablerl.adapters.trl.trainer"},
             "stablerl.adapters.verl": set(), "stablerl.adapters.trl.trainer": set(),
             "stablerl.frameworks": {"stablerl.plugins.losses"}, "stablerl.plugins.losses": set()}
    got = violations(edges)
    assert got["imports_own_package"] == [("stablerl.adapters.verl._x", "stablerl.adapters.verl")]
    assert got["adapter_imports_adapter"] == [("stablerl.adapters.verl._x", "stablerl.adapters.trl.trainer")]
    assert got["core_imports_by_name"] == [("stablerl.frameworks", "stablerl.plugins.losses")]


def test_the_checker_sees_a_core_cycle_through_a_function_level_import(tmp_path):
    """A cycle among core modules is caught, also when one of its imports is inside a function (the ops ->
    registry -> contracts -> ops kind); an import of a plugin (the plugin manager's loading) is no edge."""
    (tmp_path / "ops.py").write_text("from .contracts import Spec\n")
    (tmp_path / "contracts.py").write_text("def scores():\n    from .ops import row_sums\n")
    (tmp_path / "registry.py").write_text("import importlib\ndef load():\n    importlib.import_module('stablerl.plugins.m2po')\n")
    known = {"stablerl.ops", "stablerl.contracts", "stablerl.registry", "stablerl.plugins.m2po", "stablerl.tools.demo"}
    edges = {f"stablerl.{m}": imports_of(f"stablerl.{m}", tmp_path / f"{m}.py", known)
             for m in ("ops", "contracts", "registry")}
    edges["stablerl.plugins.m2po"] = {"stablerl.ops", "stablerl.registry"}  # a plugin imports core: no cycle
    edges["stablerl.tools.demo"] = {"stablerl.cli"}
    edges["stablerl.cli"] = {"stablerl.tools.demo", "stablerl.registry"}
    edges["stablerl.docs"] = {"stablerl.tools.demo"}
    assert edges["stablerl.registry"] == {"stablerl.plugins.m2po"}
    got = violations(edges)
    assert sorted(got["core_cycles"]) == [["stablerl.cli", "stablerl.tools.demo"], ["stablerl.contracts", "stablerl.ops"]]
    assert got["core_imports_by_name"] == [("stablerl.registry", "stablerl.plugins.m2po")]
    assert got["core_imports_tools"] == [("stablerl.docs", "stablerl.tools.demo")]
    (tmp_path / "ops.py").write_text("X = 1\n")
    edges["stablerl.ops"] = imports_of("stablerl.ops", tmp_path / "ops.py", known)
    assert violations(edges)["core_cycles"] == [["stablerl.cli", "stablerl.tools.demo"]]


def test_the_checker_sees_a_framework_named_in_core(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text("from stablerl import frameworks\nfrom stablerl.frameworks import load_adapter\n"
                    "def f(name):\n    load_adapter(name)\n    return load_adapter('trl')\n"
                    "g = frameworks.load_adapter(\"verl\").GRPOTrainer\n")
    assert load_adapter_literals(path) == [5, 6]


def test_parser_resolves_relative_and_submodule_imports(tmp_path):
    path = tmp_path / "__init__.py"
    path.write_text("from . import _a\nfrom ._b import x\nfrom stablerl.adapters.verl import LEDGER\n"
                    "def f():\n    import stablerl.adapters.verl._c.deep\n")
    known = {"stablerl.adapters.verl", "stablerl.adapters.verl._a", "stablerl.adapters.verl._b",
             "stablerl.adapters.verl._c"}
    sub = tmp_path / "_d.py"
    sub.write_text(path.read_text())
    assert imports_of("stablerl.adapters.verl", path, known) == {
        "stablerl.adapters.verl._a", "stablerl.adapters.verl._b", "stablerl.adapters.verl._c"}
    assert imports_of("stablerl.adapters.verl._d", sub, known) == {
        "stablerl.adapters.verl._a", "stablerl.adapters.verl._b", "stablerl.adapters.verl._c", "stablerl.adapters.verl"}


def test_the_checker_sees_a_plugin_importing_a_plugin(tmp_path):
    """The leaf rule can fail: module-level, relative, function-level and package imports between plugins are
    caught; imports of core are not."""
    known = {PLUGINS, f"{PLUGINS}.ppo", f"{PLUGINS}.gmpo", f"{PLUGINS}.steer", f"{PLUGINS}.rspo", "stablerl",
             "stablerl.primitives"}
    path = tmp_path / "rspo.py"
    path.write_text("from stablerl.primitives import ClipParams\nfrom .ppo import vanilla_loss\n"
                    "def f():\n    from stablerl.plugins.gmpo import gmpo_loss\n"
                    "def g():\n    import stablerl.plugins.steer\n")
    edges = {f"{PLUGINS}.rspo": imports_of(f"{PLUGINS}.rspo", path, known)}
    assert sorted(violations(edges)["plugin_imports_plugin"]) == [
        (f"{PLUGINS}.rspo", f"{PLUGINS}.gmpo"), (f"{PLUGINS}.rspo", f"{PLUGINS}.ppo"), (f"{PLUGINS}.rspo", f"{PLUGINS}.steer")]
    path.write_text("from stablerl import plugins\n")
    assert violations({f"{PLUGINS}.rspo": imports_of(f"{PLUGINS}.rspo", path, known)})["plugin_imports_plugin"] == [
        (f"{PLUGINS}.rspo", PLUGINS)]
    path.write_text("from stablerl.primitives import ClipParams\nfrom stablerl import get_spec\n")
    assert violations({f"{PLUGINS}.rspo": imports_of(f"{PLUGINS}.rspo", path, known)})["plugin_imports_plugin"] == []


def test_plugins_are_leaves():
    found = violations(graph())["plugin_imports_plugin"]
    assert found == [], "a plugin imports another plugin: move the shared piece to stablerl.primitives, or call the " \
        f"other algorithm through the registry (stablerl.get_spec): {found}"


def test_no_import_cycles_in_adapters():
    assert violations(graph())["cycles"] == []


def test_no_import_cycles_in_core():
    """Function-level imports included; imports of stablerl.plugins are the plugin manager's (module docstring)."""
    assert violations(graph())["core_cycles"] == []


def test_core_names_no_framework():
    """Only the tools (demo, bench) load an adapter by the framework's name; the rest of core reaches a framework
    through a name it is given (a declaration, a user's choice)."""
    assert core_names_a_framework() == []


def test_only_the_cli_imports_the_tools():
    assert violations(graph())["core_imports_tools"] == []


def test_no_submodule_imports_its_adapter_package():
    assert violations(graph())["imports_own_package"] == []


def test_no_adapter_imports_another_adapter():
    assert violations(graph())["adapter_imports_adapter"] == []


def test_core_imports_no_adapter_or_plugin_by_name():
    found = set(violations(graph())["core_imports_by_name"])
    assert found - KNOWN_CORE_IMPORTS == set(), "new: core must reach adapters/plugins through the plugin manager"
    assert KNOWN_CORE_IMPORTS - found == set(), "fixed: remove these from KNOWN_CORE_IMPORTS"


if __name__ == "__main__":
    problems = violations(graph())
    problems["core_names_a_framework"] = core_names_a_framework()
    new = 0
    for rule, items in problems.items():
        for item in items:
            known = rule == "core_imports_by_name" and tuple(item) in KNOWN_CORE_IMPORTS
            new += not known
            print(f"{rule}: {' -> '.join(map(str, item)) if isinstance(item, tuple) else ' <-> '.join(item)}"
                  + (" (known)" if known else ""))
    sys.exit(1 if new else 0)
