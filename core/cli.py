"""The ``stablerl`` command: list, describe, doctor, demo, bench."""

from __future__ import annotations

import argparse
import json
import sys
from importlib import metadata
from typing import Optional

from .contracts import KINDS, AlgorithmSpec
from .frameworks import (
    PRECEDENCE,
    config_lines,
    effective_hyperparameters,
    format_settings,
    get_framework,
    list_frameworks,
    load_adapter,
    reach,
    reach_counts,
    reach_table,
    selectable_in,
)
from .params import StableRLError, UnknownNameError, unknown_name_message
from .registry import get_registry

FRAMEWORK_DISTS = ("torch", "verl", "trl", "openrlhf", "transformers", "vllm", "sglang", "ray")


def _frameworks(spec: AlgorithmSpec) -> list[str]:
    return selectable_in(spec)


def spec_summary(spec: AlgorithmSpec) -> dict:
    return {
        "name": spec.name,
        "kind": spec.kind,
        "status": spec.status,
        "paper": spec.paper,
        "title": spec.title,
        "frameworks": _frameworks(spec),  # selectable or partial
        # per framework: {"status": "selectable"|"partial", "name", "needs" (partial)} or {"status": "refused", "why"}
        "reach": reach_table([spec])[0]["reach"],
        "requires": list(spec.requires),
        "optional_inputs": list(spec.optional_inputs),
        "defaults": spec.defaults(),
        "plugin": spec.plugin,
        "notes": spec.notes,
    }


#: how `stablerl list` and the generated tables write a reach status
REACH_MARK = {"selectable": "yes", "partial": "partial", "refused": "no"}


def reach_summary(counts: dict) -> str:
    """``"verl 34 selectable + 4 partial, 25 refused; ..."`` (``counts``: :func:`stablerl.frameworks.reach_counts`)."""
    return "; ".join(f"{fw} {c['selectable']} selectable + {c['partial']} partial, {c['refused']} refused"
                     for fw, c in counts.items())


def cmd_list(args: argparse.Namespace) -> int:
    specs = get_registry().list(args.kind)
    if args.json:
        print(json.dumps([spec_summary(s) for s in specs], indent=2, default=str))
        return 0
    table = reach_table(specs)
    names = [fw.name for fw in list_frameworks()]
    rows = [(s.name, s.kind, s.status, s.paper or "-", *(REACH_MARK[r["reach"][fw]["status"]] for fw in names))
            for s, r in zip(specs, table)]
    header = ("name", "kind", "status", "paper", *names)
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    print(f"\n{len(specs)} algorithms; reach: {reach_summary(reach_counts(table))}")
    if not args.kind or args.kind == "policy_loss":
        from .frameworks import top_entropy_reach

        reached = ", ".join(f"{fw}: {top_entropy_reach(fw)[0]}" for fw in names)
        print(f"call option of every per-token policy loss: top_entropy_quantile ({reached}; "
              "stablerl describe top_entropy_quantile)")
    for fw in names:
        lines = []
        for r in table:
            entry = r["reach"][fw]
            if entry["status"] == "partial":
                lines.append(f"  partial  {r['name']}: needs " + "; ".join(entry["needs"]))
            elif entry["status"] == "refused":
                lines.append(f"  refused  {r['name']}: {entry['why']}")
        if lines and not args.brief:
            print(f"\n{fw}:")
            print("\n".join(lines))
    return 0


def describe_text(spec: AlgorithmSpec) -> str:
    lines = [f"{spec.name}  ({spec.kind}, {spec.status})"]
    if spec.title:
        lines.append(spec.title)
    if spec.paper:
        lines.append(f"paper:     arXiv {spec.paper}  https://arxiv.org/abs/{spec.paper}")
    if spec.formula:
        lines.append(f"formula:   {spec.formula}")
    defaults = spec.defaults()
    lines.append("defaults:  " + (", ".join(f"{k}={v!r}" for k, v in defaults.items()) or "(none)"))
    if spec.requires:
        lines.append("requires:  " + ", ".join(spec.requires))
    if spec.optional_inputs:
        lines.append("reads if given: " + ", ".join(spec.optional_inputs))
    fixed = spec.fixed_aggregation(spec.params()) if spec.kind == "policy_loss" and spec.output == "scalar" else ""
    if fixed:
        lines.append(f"aggregation: always {fixed} (loss_agg_mode is ignored; loss_agg_params refused)")
    if spec.metrics:
        lines.append("metrics:   " + ", ".join(spec.metrics))
    if spec.reference:
        lines.append(f"reference: {spec.reference}")
    if spec.notes:
        lines.append(f"notes:     {spec.notes}")
    lines.append(f"plugin:    {spec.plugin}")
    keys = config_lines(spec)
    for framework, cfg in keys.items():
        lines.append(f"{framework}:")
        lines += [f"  {line}" for line in cfg]
    if not keys:
        lines.append("frameworks: none can run it yet (see notes / requires)")
    for framework, entry in reach_table([spec])[0]["reach"].items():
        if entry["status"] == "refused":  # every refusal says why, in the framework's words
            lines.append(f"{framework}: refused: {entry['why']}")
    return "\n".join(lines)


def framework_settings_text(spec: AlgorithmSpec, framework: str) -> str:
    """What ``spec`` runs with in ``framework`` when the user sets no key: the table each adapter
    prints at start-up, with every framework key at the framework's own default."""
    fw = get_framework(framework)
    status, detail = reach(fw, spec)
    if status == "refused":
        return f"{fw.name}: {spec.name!r} cannot be selected: {detail}"
    defaults = {name: key.default for name, key in fw.hyperparameter_keys.get(spec.kind, {}).items()}
    settings = effective_hyperparameters(fw, spec, {}, defaults)
    key = fw.selection_keys.get(spec.kind)  # none for an aggregation / correction / router family: detail says how
    return "\n".join([f"{fw.name}: select with {key}={detail}" if key else f"{fw.name}: select with {detail}",
                      format_settings(fw, spec, settings), PRECEDENCE])


def top_entropy_text() -> str:
    """``stablerl describe top_entropy_quantile``: a call option, not a registered algorithm."""
    from .frameworks import TOP_ENTROPY_TEXT, top_entropy_reach

    lines = [TOP_ENTROPY_TEXT]
    for fw in list_frameworks():
        status, detail = top_entropy_reach(fw)
        if status == "refused":
            lines.append(f"{fw.name}: refused: {detail[0]}")
        else:
            lines.append(f"{fw.name}:  (with any per-token stablerl policy loss)")
            lines += [f"  {line}" for line in detail]
    lines.append('Python: stablerl.compute_policy_loss(<loss>, ..., entropy=..., top_entropy_quantile=0.2)')
    return "\n".join(lines)


def cmd_describe(args: argparse.Namespace) -> int:
    registry = get_registry()
    if args.name == "top_entropy_quantile" and not any(s.name == args.name for s in registry.list()):
        print(top_entropy_text())
        return 0
    matches = [s for s in registry.list() if s.name == args.name]
    if not matches:
        raise UnknownNameError(unknown_name_message("algorithm", args.name, {s.name for s in registry.list()}))
    if args.framework:
        get_framework(args.framework)  # an unknown framework is an error naming the declared ones
        print("\n\n".join(describe_text(s) + "\n\n" + framework_settings_text(s, args.framework) for s in matches))
    else:
        print("\n\n".join(describe_text(s) for s in matches))
    return 0


def _version(dist: str) -> Optional[str]:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def doctor_report() -> dict:
    """Installed frameworks, stablerl's registration in each, and plugin failures."""
    registry = get_registry()
    report: dict = {
        "stablerl": _version("stablerl"),
        "packages": {d: _version(d) for d in FRAMEWORK_DISTS},
        "plugins": list(registry.plugins),
        "failures": [{"plugin": f.plugin, "error": f.error} for f in registry.failures],
        "algorithms": len(registry.specs),
        "frameworks": {},
    }
    for fw in list_frameworks():  # the declared frameworks (built-in and third-party) that are installed
        version = _version(fw.distribution)
        if version is None:
            continue
        entry: dict = {"version": version, "supported": fw.supported, "adapter": fw.adapter}
        try:
            adapter = load_adapter(fw.name)
            report_fn = getattr(adapter, "doctor_report", None)  # what the adapter can say about itself
            if callable(report_fn):
                entry.update(report_fn())
        except Exception as e:  # noqa: BLE001 - doctor reports, never crashes
            entry["error"] = f"{type(e).__name__}: {e}"
        report["frameworks"][fw.name] = entry
    return report


def conformance_report() -> list[dict]:
    """Run the conformance suite on every third-party algorithm of every kind it covers (not the
    built-ins, which the project's own tests cover). One entry per algorithm: ``ok`` or the failed property."""
    from .testing import ConformanceError, check_advantage_estimator, check_policy_loss
    from .testing.extensions import EXTENSION_CHECKS

    checks = {"policy_loss": check_policy_loss, "advantage_estimator": check_advantage_estimator, **EXTENSION_CHECKS}
    out = []
    for spec in get_registry().list():
        if spec.plugin.startswith("stablerl.plugins.") or spec.kind not in checks or spec.status == "unavailable":
            continue
        try:
            checks[spec.kind](spec.name)
            out.append({"name": spec.name, "kind": spec.kind, "plugin": spec.plugin, "ok": True})
        except (ConformanceError, StableRLError) as e:
            out.append({"name": spec.name, "kind": spec.kind, "plugin": spec.plugin, "ok": False, "error": str(e)})
    return out


def cmd_doctor(args: argparse.Namespace) -> int:
    report = doctor_report()
    if args.conformance:
        report["conformance"] = conformance_report()
    if args.json:
        print(json.dumps(report, indent=2, default=str))
    else:
        print(f"stablerl {report['stablerl']}: {report['algorithms']} algorithms from {len(report['plugins'])} plugins")
        for dist, version in report["packages"].items():
            print(f"  {dist:<13} {version or 'not installed'}")
        for framework, entry in report["frameworks"].items():
            print(f"{framework}:")
            for key, value in entry.items():
                print(f"  {key}: {value}")
        if report["failures"]:
            print("plugin failures:")
            for f in report["failures"]:
                print(f"  {f['plugin']}: {f['error']}")
        else:
            print("plugin failures: none")
        if args.conformance:
            print(f"conformance of third-party algorithms ({len(report['conformance'])}):")
            for c in report["conformance"]:
                print(f"  {c['name']} ({c['plugin']}): " + ("ok" if c["ok"] else f"FAILS: {c['error']}"))
    broken = (
        bool(report["failures"])
        or any("error" in e for e in report["frameworks"].values())
        or any(not c["ok"] for c in report.get("conformance", []))
    )
    return 1 if broken else 0


def cmd_demo(argv: list[str]) -> int:
    try:
        from stablerl.tools import demo
    except ImportError as e:
        print(f"stablerl demo needs TRL: pip install 'stablerl[trl]' ({e})", file=sys.stderr)
        return 2
    return demo.main(argv)


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    from stablerl.tools import bench  # torch-only; verl is imported lazily by the bench itself

    bench.add_arguments(p)


def cmd_bench(args: argparse.Namespace) -> int:
    from stablerl.tools import bench

    return bench.main(args=args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="stablerl", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("list", help="list registered algorithms")
    p.add_argument("--kind", choices=KINDS)
    p.add_argument("--json", action="store_true",
                   help="one object per algorithm, with 'reach': per framework selectable / partial (needs) / "
                        "refused (why)")
    p.add_argument("--brief", action="store_true", help="the table and the reach counts, without the reasons")
    p.set_defaults(func=cmd_list)
    p = sub.add_parser("describe", help="formula, defaults and config keys of one algorithm")
    p.add_argument("name")
    p.add_argument("--framework", metavar="NAME",
                   help="also print the effective hyper-parameters in that framework (verl, trl, openrlhf, or "
                        "a third-party one) and where each value comes from")
    p.set_defaults(func=cmd_describe)
    p = sub.add_parser("doctor", help="installed frameworks, registration, plugin failures")
    p.add_argument("--json", action="store_true")
    p.add_argument("--conformance", action="store_true", help="also run the conformance suite on third-party plugins")
    p.set_defaults(func=cmd_doctor)
    sub.add_parser("demo", help="train a tiny model with GRPO through TRL, once per loss (see --help)", add_help=False)
    p = sub.add_parser("bench", help="time and memory of each loss against verl's native twin (or vanilla)")
    _add_bench_arguments(p)
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return cmd_demo(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except StableRLError as e:
        print(f"stablerl: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
