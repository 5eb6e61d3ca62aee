"""Third-party plugins: discovery through entry points, isolation of broken ones, STABLERL_PLUGINS.

Each test installs throw-away plugins as real distributions (a module and a ``*.dist-info`` with
``entry_points.txt`` on a temporary ``sys.path`` entry), so discovery runs through
``importlib.metadata`` exactly as for a pip-installed package; one test fakes ``entry_points``.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
import textwrap
import warnings

import pytest
import torch

import stablerl
import stablerl.registry
from stablerl import POLICY_LOSS

GOOD = '''
import torch
from stablerl import hookimpl


def loss(b, p, ctx):
    return -b.advantages * torch.exp(b.log_prob - b.old_log_prob), {}


@hookimpl
def register_policy_losses(register):
    register(name="NAME", fn=loss, formula="l = -A r")
'''


def good(name: str) -> str:
    return GOOD.replace("NAME", name)


@pytest.fixture
def install(tmp_path, monkeypatch):
    """``install(ep_name, module, source)``: a fake installed distribution with one ``stablerl`` entry point."""
    modules: list[str] = []
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delenv("STABLERL_PLUGINS", raising=False)

    def _install(ep_name: str, module: str, source: str, value: str | None = None) -> None:
        (tmp_path / f"{module}.py").write_text(textwrap.dedent(source))
        info = tmp_path / f"{module}-0.0.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {module}\nVersion: 0.0\n")
        (info / "entry_points.txt").write_text(f"[stablerl]\n{ep_name} = {value or module}\n")
        modules.append(module)
        importlib.invalidate_caches()

    yield _install
    monkeypatch.undo()
    for m in modules:
        sys.modules.pop(m, None)
    importlib.invalidate_caches()
    stablerl.reload_registry()


def _reload(match: str | None = None):
    """Rebuild the registry; return it and the RuntimeWarnings raised while loading."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        registry = stablerl.reload_registry()
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    if match is not None:
        assert any(match in m for m in messages), messages
    return registry, messages


def _loss_works(name: str) -> float:
    lp = torch.tensor([[-1.0, -2.0]], requires_grad=True)
    loss, _ = stablerl.compute_policy_loss(
        name, log_prob=lp, old_log_prob=torch.tensor([[-1.0, -2.0]]), advantages=torch.tensor([[1.0, 1.0]]),
        response_mask=torch.tensor([[1, 1]]),
    )
    return float(loss.detach())


def test_a_good_plugin_is_discovered_and_labelled(install):
    install("good", "sr_good", good("good_loss"))
    registry, messages = _reload()
    assert messages == []
    spec = registry.get(POLICY_LOSS, "good_loss")
    assert spec.plugin == "good (sr_good)"
    assert "good (sr_good)" in registry.plugins
    assert _loss_works("good_loss") == pytest.approx(-1.0)


def test_a_plugin_that_fails_to_import_is_reported_and_skipped(install):
    install("broken", "sr_broken", "raise ImportError('needs flash_attn_9')\n")
    install("good", "sr_good", good("good_loss"))
    registry, _ = _reload(match="plugin 'broken (sr_broken)' skipped: import failed: ImportError: needs flash_attn_9")
    assert [f.plugin for f in stablerl.get_registry().failures] == ["broken (sr_broken)"]
    assert "needs flash_attn_9" in registry.failures[0].detail  # the traceback, for `stablerl doctor`
    # everything else keeps working: built-ins and the other third-party plugin
    assert _loss_works("vanilla") == pytest.approx(-1.0)
    assert _loss_works("good_loss") == pytest.approx(-1.0)


def test_an_entry_point_naming_a_missing_attribute_is_reported(install):
    install("typo", "sr_typo", good("typo_loss"), value="sr_typo:not_there")
    registry, _ = _reload(match="plugin 'typo (sr_typo:not_there)' skipped: import failed: AttributeError")
    assert "typo_loss" not in registry.names(POLICY_LOSS)


def test_a_name_clash_with_a_builtin_keeps_the_builtin(install):
    builtin = stablerl.get_registry().get(POLICY_LOSS, "vanilla")
    install("clash", "sr_clash", good("vanilla") + textwrap.dedent('''
        @hookimpl
        def register_advantage_estimators(register):
            register(name="clash_estimator", fn=lambda b, p, c: (b.token_level_rewards, b.token_level_rewards),
                     formula="A = r")
    '''))
    # the warning says what happened: that name is not registered, the plugin's others are
    registry, _ = _reload(match="plugin 'clash (sr_clash)' policy_loss 'vanilla' not registered (its other names "
                                "are): name clash: policy_loss 'vanilla' is already registered by 'stablerl.plugins.ppo'")
    kept = registry.get(POLICY_LOSS, "vanilla")
    assert kept.plugin == "stablerl.plugins.ppo" and kept.fn is builtin.fn
    assert [f.error.split(":")[0] for f in registry.failures] == ["name clash"]
    # the clashing name alone is refused; the plugin's other names still register
    assert registry.get("advantage_estimator", "clash_estimator").plugin == "clash (sr_clash)"


def test_two_third_party_plugins_with_one_name_first_wins(install):
    install("aaa", "sr_aaa", good("shared_loss"))
    install("bbb", "sr_bbb", good("shared_loss"))
    registry, messages = _reload()
    owner = registry.get(POLICY_LOSS, "shared_loss").plugin
    assert owner in ("aaa (sr_aaa)", "bbb (sr_bbb)")
    loser = "bbb (sr_bbb)" if owner.startswith("aaa") else "aaa (sr_aaa)"
    assert [f.plugin for f in registry.failures] == [loser]
    assert any("name clash" in m and loser in m for m in messages)


@pytest.mark.parametrize("where", ["import", "hook"])
def test_a_plugin_calling_sys_exit_is_isolated(install, where):
    """SystemExit is not an Exception: a plugin that exits at import or in its hook must not end every
    registry access (and `stablerl list` / `doctor`) with no message."""
    body = "import sys\nsys.exit(3)\n" if where == "import" else '''
        import sys
        from stablerl import hookimpl

        @hookimpl
        def register_policy_losses(register):
            sys.exit(3)
    '''
    install("quitter", "sr_quitter", body)
    install("good", "sr_good", good("good_loss"))
    what = "import failed" if where == "import" else "registration failed"
    registry, _ = _reload(match=f"plugin 'quitter (sr_quitter)' skipped: {what}: SystemExit: 3")
    assert "good_loss" in registry.names(POLICY_LOSS) and "vanilla" in registry.names(POLICY_LOSS)


def test_a_plugin_raising_inside_its_hook_registers_nothing(install):
    install("raiser", "sr_raiser", '''
        import torch
        from stablerl import hookimpl

        @hookimpl
        def register_policy_losses(register):
            register(name="raiser_first", fn=lambda b, p, c: (b.log_prob, {}), formula="l = lp")
            raise RuntimeError("config file missing")
    ''')
    install("good", "sr_good", good("good_loss"))
    registry, _ = _reload(match="plugin 'raiser (sr_raiser)' skipped: registration failed: RuntimeError: config "
                                "file missing")
    assert "raiser_first" not in registry.names(POLICY_LOSS)  # nothing half-registered
    assert "good_loss" in registry.names(POLICY_LOSS)


def test_a_plugin_with_an_invalid_spec_is_skipped(install):
    install("badspec", "sr_badspec", '''
        from stablerl import hookimpl

        @hookimpl
        def register_policy_losses(register):
            register(name="needs_magic", fn=lambda b, p, c: (b.log_prob, {}), requires=("magic",))
    ''')
    registry, _ = _reload(match="plugin 'badspec (sr_badspec)' skipped: registration failed: ValueError: "
                                "'needs_magic' requires unknown input 'magic'")
    assert "needs_magic" not in registry.names()


def test_a_hookimpl_with_wrong_arguments_is_an_invalid_plugin(install):
    install("badhook", "sr_badhook", '''
        from stablerl import hookimpl

        @hookimpl
        def register_policy_losses(reg):  # the hook's argument is called `register`
            pass
    ''')
    registry, _ = _reload(match="plugin 'badhook (sr_badhook)' skipped: invalid plugin")
    assert [f.plugin for f in registry.failures] == ["badhook (sr_badhook)"]
    assert "vanilla" in registry.names(POLICY_LOSS)


def test_stablerl_plugins_none_loads_no_third_party_plugin(install, monkeypatch):
    install("good", "sr_good", good("good_loss"))
    install("broken", "sr_broken", "raise ImportError('boom')\n")
    monkeypatch.setenv("STABLERL_PLUGINS", "none")
    registry, messages = _reload()
    assert messages == [] and registry.failures == []  # the broken one is not even imported
    assert "good_loss" not in registry.names()
    assert "sr_broken" not in sys.modules
    assert all(p.startswith(("stablerl.plugins.", "stablerl.adapters.frameworks")) for p in registry.plugins)
    assert sorted(registry.frameworks) == ["openrlhf", "skyrl", "trl", "verl"]  # built-in declarations still load
    assert "vanilla" in registry.names(POLICY_LOSS)  # built-ins always load


def test_stablerl_plugins_allow_list_loads_only_the_named(install, monkeypatch):
    install("good", "sr_good", good("good_loss"))
    install("other", "sr_other", good("other_loss"))
    install("broken", "sr_broken", "raise ImportError('boom')\n")
    monkeypatch.setenv("STABLERL_PLUGINS", " other , good")
    registry, messages = _reload()
    assert messages == []
    assert {"good_loss", "other_loss"} <= set(registry.names(POLICY_LOSS))
    monkeypatch.setenv("STABLERL_PLUGINS", "other")
    registry, _ = _reload()
    assert "other_loss" in registry.names(POLICY_LOSS) and "good_loss" not in registry.names(POLICY_LOSS)
    monkeypatch.setenv("STABLERL_PLUGINS", "all")
    registry, _ = _reload(match="plugin 'broken (sr_broken)' skipped")
    assert {"good_loss", "other_loss"} <= set(registry.names(POLICY_LOSS))


def test_reload_registry_picks_up_a_newly_installed_plugin(install):
    before = stablerl.reload_registry()
    install("late", "sr_late", good("late_loss"))
    assert stablerl.get_registry() is before  # cached until reloaded
    with pytest.raises(stablerl.UnknownNameError, match="unknown policy loss 'late_loss'"):
        _loss_works("late_loss")
    after = stablerl.reload_registry()
    assert after is not before and stablerl.get_registry() is after
    assert _loss_works("late_loss") == pytest.approx(-1.0)


def test_a_faked_entry_point_group_is_what_gets_loaded(monkeypatch):
    """The same behaviour with ``entry_points`` itself replaced (no files on disk)."""
    sys.modules["sr_fake_mod"] = fake = type(sys)("sr_fake_mod")
    exec(textwrap.dedent(good("fake_loss")), fake.__dict__)
    eps = [
        importlib.metadata.EntryPoint("fake", "sr_fake_mod", "stablerl"),
        importlib.metadata.EntryPoint("ghost", "sr_no_such_module", "stablerl"),
    ]
    seen_groups = []

    real_entry_points = stablerl.registry.entry_points

    def fake_entry_points(*, group):
        seen_groups.append(group)
        return eps if group == "stablerl" else real_entry_points(group=group)

    monkeypatch.setattr(stablerl.registry, "entry_points", fake_entry_points)
    monkeypatch.delenv("STABLERL_PLUGINS", raising=False)
    try:
        registry, _ = _reload(match="plugin 'ghost (sr_no_such_module)' skipped: import failed: ModuleNotFoundError")
        assert seen_groups == ["stablerl.builtin", "stablerl"]
        assert registry.get(POLICY_LOSS, "fake_loss").plugin == "fake (sr_fake_mod)"
        assert [f.plugin for f in registry.failures] == ["ghost (sr_no_such_module)"]
    finally:
        monkeypatch.undo()
        sys.modules.pop("sr_fake_mod", None)
        stablerl.reload_registry()


def test_a_typo_in_a_hook_name_is_reported(install):
    install("typo", "sr_hooktypo", '''
        from stablerl import hookimpl

        @hookimpl
        def register_policy_loss(register):  # missing "es"
            register(name="never_seen", fn=lambda b, p, c: (b.log_prob, {}), formula="l = lp")
    ''')
    registry, _ = _reload()
    assert [f.plugin for f in registry.failures] == ["typo (sr_hooktypo)"]
