"""The ``parity`` nox session: compare the frameworks' parity-matrix results and write docs/parity-matrix.md.

    python integrations_tests/parity/parity_report.py [--check]

Reads ``$STABLERL_PARITY_DIR/{verl,trl,openrlhf,skyrl}.json`` (default ``build/parity/``), written by each
framework session's ``test_parity_matrix.py``. Fails (exit 1) when a results file is missing (naming
the session to run first), when the files disagree on the algorithms or the batch, or when an
algorithm's values differ between two frameworks (rel 1e-6) without a listed reason. Needs torch only
(not stablerl: the results files carry everything). ``--check``: compare, and fail if the committed
docs/parity-matrix.md is not what the results generate, instead of writing it.
"""

from __future__ import annotations

import json
import math
import os
import sys
from itertools import combinations
from pathlib import Path

import torch

FRAMEWORKS = ("verl", "trl", "openrlhf", "skyrl")
TITLES = {"verl": "verl", "trl": "TRL", "openrlhf": "OpenRLHF", "skyrl": "SkyRL"}
KIND_TITLES = {"policy_loss": "Policy losses", "advantage_estimator": "Advantage estimators"}
REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "parity-matrix.md"
# setting -> (section title, what was set)
SETTINGS = {
    "explicit": ("Every hyper-parameter set", "Each one set to the algorithm's default, in each framework's own keys."),
    "defaults": ("Nothing set", "What selecting the algorithm by name gives in each framework."),
    "no_std_knob": ("Framework knob: advantages not divided by the group std",
                    "Only the framework's own knob set (verl `algorithm.norm_adv_by_std_in_grpo=False`, TRL "
                    "`scale_rewards=\"none\"`, OpenRLHF `--algo.advantage.no_std_norm`, SkyRL "
                    "`trainer.algorithm.grpo_norm_by_std=false`), for the estimators with a "
                    "`norm_adv_by_std_in_grpo` hyper-parameter; expected: the estimator with it False."),
}
IDENTICAL, DIFFERS, NOT_OFFERED = "identical", "differs", "not offered"


class ParityError(Exception):
    pass


def results_dir() -> Path:
    """``$STABLERL_PARITY_DIR``, default ``build/parity/`` in the repository (git-ignored)."""
    return Path(os.environ.get("STABLERL_PARITY_DIR") or REPO / "build" / "parity")


def load(directory: Path) -> dict[str, dict]:
    out, missing = {}, []
    for fw in FRAMEWORKS:
        path = directory / f"{fw}.json"
        if not path.exists():
            missing.append(f"{path} (run `nox -s {fw}` first)")
            continue
        out[fw] = json.loads(path.read_text())
    if missing:
        raise ParityError("missing parity results: " + "; ".join(missing))
    return out


def relative_difference(value, reference) -> float:
    """max |value - reference| / max(|reference|_max, 1e-30): one number per tensor (a gradient's tiny
    entries are compared at the scale of its largest, so summation order does not count as a difference)."""
    v = torch.as_tensor(value, dtype=torch.float64)
    r = torch.as_tensor(reference, dtype=torch.float64)
    if v.shape != r.shape:
        return math.inf
    if not (torch.isfinite(v).all() and torch.isfinite(r).all()):  # equal only where both are the same non-finite
        same = torch.equal(v.nan_to_num(), r.nan_to_num()) and torch.equal(v.isnan(), r.isnan())
        return 0.0 if same else math.inf
    scale = max(float(r.abs().max()) if r.numel() else 0.0, 1e-30)
    return float((v - r).abs().max()) / scale if v.numel() else 0.0


def compare(results: dict[str, dict]) -> list[str]:
    """Every problem found; empty when the frameworks agree wherever no reason is listed."""
    problems = []
    keys = {fw: set(r["algorithms"]) for fw, r in results.items()}
    union = set().union(*keys.values())
    for fw, ks in keys.items():
        if ks != union:
            problems.append(f"{fw}.json lacks {sorted(union - ks)} (rerun `nox -s {fw}`: a partial run wrote it)")
    rtol = min(float(r["rtol"]) for r in results.values())
    for key in sorted(union):
        cells = {fw: r["algorithms"][key] for fw, r in results.items() if key in r["algorithms"]}
        for fw, cell in cells.items():
            if cell["status"] == DIFFERS and cell["reason"].startswith("UNLISTED"):
                problems.append(f"{key}: {fw} differs from the core call without a listed reason: {cell['reason']}")
        ran = {fw: c for fw, c in cells.items() if c["values"]}
        for (fa, a), (fb, b) in combinations(ran.items(), 2):
            if a["hyperparameters"] != b["hyperparameters"]:
                problems.append(f"{key}: {fa} and {fb} ran different hyper-parameters")
            if a["core"] != b["core"]:  # same batch, same core call: the environments must agree
                worst = max(relative_difference(a["core"][k], b["core"][k]) for k in a["core"])
                if not worst <= rtol:
                    problems.append(f"{key}: the core call differs between the {fa} and {fb} environments "
                                    f"({worst:.3g})")
            listed = a["status"] == DIFFERS or b["status"] == DIFFERS
            for k in a["values"]:
                d = relative_difference(a["values"][k], b["values"].get(k, []))
                if not d <= rtol and not listed:
                    problems.append(f"{key}: {fa} and {fb} differ in {k} (rel {d:.3g}) and no reason is listed")
    return problems


def _cell(cell: dict) -> str:
    if cell["status"] == IDENTICAL:
        return "identical"
    if cell["status"] == NOT_OFFERED:
        return f"not offered because {cell['reason']}"
    text = f"differs because {cell['reason']}"
    return text + " **(to fix)**" if cell.get("to_fix") else text


def render(results: dict[str, dict]) -> str:
    first = results[FRAMEWORKS[0]]
    versions = ", ".join(f"{TITLES[fw]} {r['version']}" for fw, r in results.items())
    lines = [
        "# Cross-framework parity matrix",
        "",
        "<!-- generated by integrations_tests/parity/parity_report.py (nox -s parity); do not edit -->",
        "",
        "Every policy loss and advantage estimator that two or more frameworks offer, fed the same "
        "deterministic fp32 batch through each framework's real call site, under the settings below (every "
        "hyper-parameter set to the same value in each framework; nothing set; a framework knob set). "
        "The call sites: verl's "
        "`verl.workers.utils.losses.ppo_loss` and `ray_trainer.compute_advantage`; TRL's stablerl "
        "`GRPOTrainer._compute_loss` and its advantage step; OpenRLHF's stablerl policy loss built from "
        "OpenRLHF args and the patched `RemoteExperienceMaker.compute_advantages_and_returns`; SkyRL's "
        "`PolicyLossRegistry` loss fed by the stablerl trainer's `_normalize_advantages` and "
        "`ppo_utils.compute_advantages_and_returns`. "
        f"*identical*: loss, gradient with respect to the log-probs, and advantages equal the direct "
        f"`stablerl.compute_policy_loss` / `stablerl.compute_advantage` call and each other within rel "
        f"{first['rtol']:g} (largest entry's scale), under each loss aggregation all four offer: "
        + ", ".join(f"`{m}`" for m in first["loss_agg_modes"]) + ".",
        "",
        f"Measured with {versions}, torch {first['torch']}. Reasons for differences are listed in "
        "`integrations_tests/parity/parity_matrix.py` (`KNOWN_DIFFERENCES`); **(to fix)** marks a stablerl "
        "bug rather than a framework's documented behaviour.",
    ]
    for setting in first["settings"]:
        title, what = SETTINGS.get(setting, (setting, ""))
        lines += ["", f"## {title}", "", what]
        for kind, kind_title in KIND_TITLES.items():
            rows = sorted(k for k, c in first["algorithms"].items() if c["setting"] == setting and c["kind"] == kind)
            if not rows:
                continue
            header = "| algorithm | " + " | ".join(TITLES[f] for f in FRAMEWORKS) + " |"
            lines += ["", f"### {kind_title}", "", header, "|---|" + "---|" * len(FRAMEWORKS)]
            for key in rows:
                name = first["algorithms"][key]["name"]
                cells = [_cell(results[fw]["algorithms"][key]).replace("|", "\\|") for fw in FRAMEWORKS]
                lines.append(f"| `{name}` | " + " | ".join(cells) + " |")
    by_design = {(name, fw): note for fw, r in results.items() for name, note in (r.get("by_design") or {}).items()}
    if by_design:
        lines += ["", "## Differences by each framework's design (same numbers for the same inputs)", "",
                  "What a framework hands an algorithm can mean something else there; each framework's "
                  "declaration says so (`stablerl describe NAME` shows it too).", ""]
        lines += [f"* `{name}` in {TITLES[fw]}: {note}" for (name, fw), note in sorted(by_design.items())]
    overrides = first.get("overrides") or {}
    if overrides:
        lines += ["", "## Hyper-parameters other than the defaults", ""]
        lines += [f"* `{key.split('/')[-1]}`: {text}" for key, text in sorted(overrides.items())]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    check = "--check" in argv
    try:
        results = load(results_dir())
    except ParityError as exc:
        print(f"parity: {exc}", file=sys.stderr)
        return 1
    problems = compare(results)
    text = render(results)
    if check:
        if not DOC.exists() or DOC.read_text() != text:
            problems.append(f"{DOC.relative_to(REPO)} is not what the results generate: run `nox -s parity`")
    else:
        DOC.write_text(text)
        print(f"parity: wrote {DOC.relative_to(REPO)}")
    for p in problems:
        print(f"parity: {p}", file=sys.stderr)
    if problems:
        return 1
    n = len({(c["kind"], c["name"]) for c in results[FRAMEWORKS[0]]["algorithms"].values()})
    print(f"parity: {n} algorithms, no unlisted difference across {', '.join(FRAMEWORKS)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
