"""The `stablerl` CLI (list, describe, doctor) and the generated docs pages."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

import stablerl
from stablerl import cli, docs

ROOT = Path(__file__).resolve().parents[1]


def run_cli(capsys, *argv):
    code = cli.main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_list_json_has_required_fields(capsys):
    code, out, _ = run_cli(capsys, "list", "--json")
    assert code == 0
    rows = json.loads(out)
    names = {r["name"] for r in rows}
    assert {"vanilla"} <= names
    for r in rows:
        assert {"name", "kind", "status", "paper", "frameworks"} <= set(r)
        assert r["status"] in ("stable", "experimental", "unavailable")
    vanilla = next(r for r in rows if r["name"] == "vanilla")
    assert vanilla["frameworks"] == ["verl", "trl", "openrlhf", "skyrl"] and vanilla["paper"] == "2503.14476"


def test_list_filters_by_kind(capsys):
    code, out, _ = run_cli(capsys, "list", "--kind", "policy_loss", "--json")
    assert code == 0 and {r["kind"] for r in json.loads(out)} == {"policy_loss"}
    with pytest.raises(SystemExit):
        cli.main(["list", "--kind", "losses"])


def test_list_table(capsys):
    code, out, _ = run_cli(capsys, "list")
    assert code == 0 and out.splitlines()[0].split() == ["name", "kind", "status", "paper", "verl", "trl", "openrlhf",
                                                    "skyrl"]
    assert f"{len(stablerl.list_algorithms())} algorithms; reach: verl " in out
    pacs = next(line.split() for line in out.splitlines() if line.startswith("pacs "))
    # verl, OpenRLHF and SkyRL: whole prompt groups under a setting
    assert pacs[-4:] == ["partial", "yes", "partial", "partial"]
    erc = next(line.split() for line in out.splitlines() if line.startswith("erc "))
    assert erc[-4:] == ["partial", "yes", "yes", "yes"]  # SkyRL: the old-log-prob pass's entropy (issue 27)
    d3s = next(line.split() for line in out.splitlines() if line.startswith("d3s "))
    assert d3s[-4:] == ["partial", "yes", "yes", "yes"]
    assert "  partial  pacs: needs index: trainer.micro_train_batch_size_per_gpu a multiple of" in out
    # every partial says what to set, every refusal why, per framework
    assert "  partial  pacs: needs index: --train.micro_batch_size" in out
    assert "  partial  pacs: needs index: the legacy trainer (trainer.use_v1=false), actor_rollout_ref.actor." in out
    assert "  partial  d3s: needs entropy: the legacy trainer (trainer.use_v1=false) without bypass mode" in out
    assert "  refused  aepo: needs rollout_temperature (rollout_temperature: verl's rollout temperature" in out
    code, brief, _ = run_cli(capsys, "list", "--brief")
    assert "refused  d3s" not in brief and "reach: verl" in brief


def test_list_json_reach_per_framework(capsys):
    from stablerl.frameworks import reach_counts, reach_table

    code, out, _ = run_cli(capsys, "list", "--json")
    rows = {r["name"]: r for r in json.loads(out)}
    assert rows["pacs"]["reach"]["openrlhf"]["status"] == "partial"
    assert "--rollout.n_samples_per_prompt" in rows["pacs"]["reach"]["openrlhf"]["needs"][0]
    assert rows["remax"]["reach"]["trl"] == {
        "status": "refused", "why": "needs reward_baselines (reward_baselines: TRL's GRPOTrainer generates no greedy "
        "baseline response per prompt (ReMax))"}
    # turn ids default to the loss mask's runs of trained tokens, so turn_ppo runs everywhere
    assert rows["turn_ppo"]["reach"]["verl"] == {"status": "selectable", "name": "turn_ppo"}
    assert rows["vanilla"]["reach"]["verl"] == {"status": "selectable", "name": "stablerl_vanilla"}
    # the counts stablerl list and README print come from the same rows
    counts = {fw: {s: 0 for s in ("selectable", "partial", "refused")} for fw in ("verl", "trl", "openrlhf", "skyrl")}
    for r in json.loads(out):  # every row: a name may be used by two kinds (gpg: a loss and an estimator)
        for fw, entry in r["reach"].items():
            counts[fw][entry["status"]] += 1
    assert counts == reach_counts(reach_table())
    assert counts["openrlhf"]["partial"] >= 3  # pacs, gvpo, gtpo: prompt groups through the replay buffer


def test_readme_table_is_generated_from_the_reach_rows():
    text = (ROOT / "README.md").read_text()
    table = text[text.index(docs.README_BEGIN):text.index(docs.README_END)]
    assert "| [`pacs`](docs/algorithms/policy_loss/pacs.md) | policy_loss | " in table
    assert "| partial | yes | partial |" in table.split("`pacs`")[1].splitlines()[0]
    page = docs.page(stablerl.get_spec("policy_loss", "a3po"))
    assert "| verl | partial | as `a3po`; needs versions: the legacy trainer (trainer.use_v1=false)" in page
    assert "| trl | selectable | as `erc` |" in docs.page(stablerl.get_spec("policy_loss", "erc"))


def test_describe_shows_formula_defaults_and_config_keys(capsys):
    code, out, _ = run_cli(capsys, "describe", "vanilla")
    assert code == 0
    assert "formula:" in out and "clip_ratio_high=0.28" in out
    # verl ships `vanilla`, so ours is reachable only under the prefixed name
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=stablerl_vanilla" in out
    assert 'GRPOConfig(loss_type="vanilla"' in out


def test_describe_unknown_name_suggests(capsys):
    code, _, err = run_cli(capsys, "describe", "vanila")
    assert code == 2 and "did you mean 'vanilla'" in err


def test_doctor_json_reports_packages_and_failures(capsys):
    code, out, _ = run_cli(capsys, "doctor", "--json")
    report = json.loads(out)
    assert report["algorithms"] == len(stablerl.get_registry().specs)
    assert "torch" in report["packages"] and report["packages"]["torch"]
    assert report["failures"] == [] and code == 0


def test_console_script_entry_point():
    out = subprocess.run([sys.executable, "-m", "stablerl.cli", "list", "--kind", "policy_loss"], capture_output=True, text=True)
    assert out.returncode == 0 and "vanilla" in out.stdout


def test_generated_docs_are_current():
    """Every built-in has a page under docs/algorithms, generated from its spec (`python -m stablerl.docs`)."""
    assert docs.main(["--out", str(ROOT / "docs" / "algorithms"), "--check"]) == 0


def test_docs_page_content():
    spec = stablerl.get_spec("policy_loss", "vanilla")
    text = docs.page(spec)
    assert "arXiv 2503.14476" in text and "| `clip_ratio_c` | `3.0` |" in text
    assert "actor_rollout_ref.actor.policy_loss.loss_mode=stablerl_vanilla" in text


def test_doctor_runs_conformance_on_third_party_plugins(capsys):
    from stablerl import POLICY_LOSS, AlgorithmSpec

    def broken_loss(b, p, ctx):  # claims a scalar but returns one value per sequence
        return -(b.advantages * b.log_prob).sum(-1), {}

    reg = stablerl.get_registry()
    spec = AlgorithmSpec(name="doctor_probe", kind=POLICY_LOSS, fn=broken_loss, formula="l = -A lp",
                         output="scalar", plugin="probe (x)")
    reg.specs[(POLICY_LOSS, "doctor_probe")] = spec
    try:
        report = cli.conformance_report()
        assert [c["name"] for c in report] == ["doctor_probe"]
        code, out, _ = run_cli(capsys, "doctor", "--conformance")
    finally:
        del reg.specs[(POLICY_LOSS, "doctor_probe")]
    assert "conformance of third-party algorithms (1)" in out and "doctor_probe (probe (x)): " in out
    assert report[0]["ok"] is False and "expected a scalar" in report[0]["error"]
    assert "doctor_probe (probe (x)): FAILS" in out and code == 1


def test_describe_framework_for_options_and_router_families(capsys):
    """Kinds without a selection key of their own say how they are set (no KeyError)."""
    code, out, _ = run_cli(capsys, "describe", "delta_l", "--framework", "trl")
    assert code == 0 and 'trl: select with stablerl_loss_params={"loss_agg_mode": "delta_l"}' in out
    assert 'alpha = 1.0  (paper default: stablerl_loss_params={"loss_agg_params": {"alpha": <value>}})' in out
    code, out, _ = run_cli(capsys, "describe", "qwen3_moe", "--framework", "openrlhf")
    assert code == 0 and "openrlhf: select with --actor.stablerl_routing_replay R2" in out


def test_the_builtins_page_agrees_with_stablerl_list():
    """docs/framework-builtins.md: its generated reach table is current (``python -m stablerl.docs``), and every
    "refused in ..." it says of an algorithm in a table row is what ``stablerl list --json`` says."""
    import re
    from pathlib import Path

    from stablerl import docs
    from stablerl.frameworks import list_frameworks, reach_table

    page = Path(__file__).resolve().parents[1] / "docs" / docs.BUILTINS_PAGE
    text = page.read_text()
    assert text == docs.builtins_page(text), "docs/framework-builtins.md is out of date: run python -m stablerl.docs"
    spelled = {"verl": "verl", "trl": "TRL", "openrlhf": "OpenRLHF", "skyrl": "SkyRL"}
    reach = {row["name"]: row["reach"] for row in reach_table(docs.builtins_page_specs(text))}
    claims = 0
    for line in text.split(docs.BUILTINS_BEGIN)[0].splitlines():
        cells = line.split(" | ")
        if not line.startswith("| `") or len(cells) < 2:
            continue
        names = [n for n in re.findall(r"`([a-z0-9_]+)`", cells[1]) if n in reach]
        for claim in re.findall(r"refused in (all three|[A-Za-z]+(?: / [A-Za-z]+)*)", line):
            frameworks = ([fw.name for fw in list_frameworks()][:3] if claim == "all three"
                          else [k for k, v in spelled.items() if v in claim.split(" / ")])
            for name in names:
                for fw in frameworks:
                    claims += 1
                    assert reach[name][fw]["status"] == "refused", (name, fw, reach[name][fw])
    assert claims >= 3  # remax in all three, at least
