"""``stablerl bench``'s estimator section against verl's real estimators (small shape)."""

import time

from stablerl.tools import bench
from stablerl.tools.bench import estimators


def test_estimator_bench_pairs_agree_with_verl_and_report_ratios():
    core_algos = bench._verl_core_algos()
    result = estimators.run(core_algos, repeats=3, clock=time.thread_time, shape=("B64xT16", 64, 16), group=4)
    assert set(result) >= {"grpo", "dr_grpo", "rloo", "opo", "qae", "bnpo"}
    for name, entry in result.items():
        (case,) = entry["cases"].values()
        assert "error" not in case, (name, case)
        assert case["time_ratio"] > 0 and entry["time_ratio"] == case["time_ratio"]
    for name in ("grpo", "dr_grpo", "rloo"):  # the twins compute the same advantages
        (case,) = result[name]["cases"].values()
        assert case["adv_max_abs_diff"] == 0.0, name
    # opo's baseline is the group mean plus the weighted mean of the deviations from it (equal scores then give
    # exactly 0): it may differ from verl's plain weighted mean by an fp32 ulp of the scores
    (case,) = result["opo"]["cases"].values()
    assert case["adv_max_abs_diff"] <= 2.5e-7
    assert result["grpo"]["baseline"] == "verl:grpo_vectorized"
    (grpo,) = result["grpo"]["cases"].values()
    assert grpo["loop_baseline"] == "verl:grpo" and grpo["loop_time_ratio"] > 0
    assert "| grpo | verl:grpo_vectorized | B64xT16/g4 |" in "\n".join(estimators.markdown(result))
