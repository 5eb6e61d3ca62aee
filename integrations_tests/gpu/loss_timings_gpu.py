"""GPU cost of stablerl's policy losses against verl's native twins (or stablerl's vanilla). Prints one JSON object.

Same measurement as ``stablerl bench`` (``stablerl.tools.bench``), on CUDA: forward + backward of
ours (``stablerl.compute_policy_loss``) and of the native function on the same inputs, interleaved in
one process (order alternating per repeat), at B=64 T=4096 and B=4 T=65536, fp32 and bf16. Time is
wall clock around a synchronised step; memory is the CUDA peak allocated above the live inputs
(``torch.cuda.max_memory_allocated``), plus ``saved_ratio`` (bytes the autograd graph keeps for
backward, the CPU measure). verl is optional: without it every loss is measured against stablerl's
vanilla only.

Usage: python integrations_tests/gpu/loss_timings_gpu.py [--quick] [--repeats N] [--dtypes fp32,bf16] [--out FILE.md]
Exits 0 with a message when CUDA is not available. Run it together with the routing-replay check:

    python integrations_tests/gpu/loss_timings_gpu.py > $OUT/loss_timings.json && \\
    python integrations_tests/gpu/routing_replay_gpu.py > $OUT/routing_replay.json
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _import_bench():
    """stablerl.tools.bench, from the source tree when stablerl is not installed."""
    try:
        import stablerl  # noqa: F401
    except ImportError:
        for name, folder in (("stablerl", "core"), ("stablerl.plugins", "plugins"), ("stablerl.adapters", "adapters")):
            spec = importlib.util.spec_from_file_location(
                name, os.path.join(ROOT, folder, "__init__.py"), submodule_search_locations=[os.path.join(ROOT, folder)])
            mod = importlib.util.module_from_spec(spec)
            sys.modules[name] = mod
            spec.loader.exec_module(mod)
    from stablerl.tools import bench

    return bench


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="B=64 T=4096 only, 7 repeats")
    ap.add_argument("--repeats", type=int, default=None)
    ap.add_argument("--dtypes", default="fp32,bf16")
    ap.add_argument("--losses", default=None, help="comma-separated subset")
    ap.add_argument("--out", default=None, help="also write the markdown tables here")
    a = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "CUDA is not available; nothing measured"}))
        return 0
    bench = _import_bench()
    shapes = [("B64xT4096", 64, 4096)] if a.quick else bench.FULL_SHAPES
    result = bench.run(
        device="cuda",
        shapes=shapes,
        repeats=a.repeats or (7 if a.quick else 21),
        dtypes=tuple(d for d in a.dtypes.split(",") if d),
        losses=a.losses.split(",") if a.losses else None,
        log=lambda s: print(s, file=sys.stderr, flush=True),
    )
    if a.out:
        with open(a.out, "w") as f:
            f.write(bench.markdown(result) + "\n")
    print(json.dumps(result, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
