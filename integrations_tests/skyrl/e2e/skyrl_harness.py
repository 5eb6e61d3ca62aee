"""Run ``launch.py`` (the stablerl SkyRL entry point with the test's stand-ins) as a user runs the entry point: a new
Python process with the stand-ins and the CPU shim on PYTHONPATH; returns its output and the per-step metrics dicts
SkyRL's trainer logs (``... - {'policy_entropy': ..., 'grad_norm': ...}``)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
STUBS = HERE.parent / "stubs"
METRICS = re.compile(r"(\{'policy_entropy': [^\n]*?\})")


def overrides(root: Path, **extra) -> list[str]:
    base = {
        "trainer.policy.model.path": root / "model", "data.train_data": f"['{root / 'prompts.jsonl'}']",
        "data.val_data": "[]", "data.dataloader.num_workers": 0, "trainer.strategy": "fsdp",
        "trainer.placement.colocate_all": "false", "trainer.placement.colocate_policy_ref": "false",
        "trainer.algorithm.use_kl_loss": "false", "trainer.flash_attn": "false",
        "trainer.remove_microbatch_padding": "false", "trainer.bf16": "false", "trainer.seed": 0,
        "trainer.train_batch_size": 4, "trainer.policy_mini_batch_size": 4, "generator.n_samples_per_prompt": 4,
        "trainer.micro_train_batch_size_per_gpu": 4, "trainer.micro_forward_batch_size_per_gpu": 4,
        "trainer.max_prompt_length": 16, "generator.sampling_params.max_generate_length": 8,
        "trainer.eval_interval": -1, "trainer.logger": "console", "trainer.ckpt_interval": 1,
        "trainer.ckpt_path": root / "ckpt", "trainer.export_path": root / "export", "trainer.log_path": root / "logs",
        "trainer.policy.optimizer_config.lr": 1e-3, "trainer.enable_ray_gpu_monitor": "false",
        "generator.inference_engine.enable_ray_prometheus_stats": "false",
    }
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


def launch(args: list[str], timeout: int = 420) -> tuple[int, str, list[dict]]:
    env = dict(os.environ)
    paths = [str(STUBS), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)), STABLERL_SKYRL_CPU="1",
               RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false", TORCHDYNAMO_DISABLE="1",
               HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1", OMP_NUM_THREADS="1",
               SKYRL_DUMP_INFRA_LOG_TO_STDOUT="1", PYTHONUNBUFFERED="1",
               # a loaded 2-core machine: Ray's default 10 s for the raylet to register is too short
               RAY_raylet_start_wait_time_s="120")
    for _attempt in range(2):  # a Ray head that did not come up (before any training) is started once more
        proc = subprocess.run([sys.executable, str(HERE / "launch.py"), *args], env=env, capture_output=True,
                              text=True, timeout=timeout)
        out = proc.stdout + proc.stderr
        if proc.returncode == 0 or "timed out during startup" not in out:
            break
    metrics = [ast.literal_eval(m) for m in METRICS.findall(out)]
    return proc.returncode, out, metrics
