"""The end-to-end run of ``python -m stablerl.adapters.openrlhf.train_ppo_ray`` on CPU (test-only).

:func:`make_assets` writes the tiny model, tokenizer, prompts and reward function; :class:`RayCluster` starts
a local Ray head with 2 logical GPUs (OpenRLHF's placement groups ask for ``{"GPU": 1, "CPU": 1}`` bundles;
on CPU the GPU is only a scheduling label) whose workers see the vLLM stand-in (``../stubs``) and the CPU
shim (``orlhf_cpu``); :func:`launch` runs the entry point as a user would and returns its output and the
per-step status dicts OpenRLHF logs (``✨ Global step N: {...}``).
"""

from __future__ import annotations

import ast
import json
import os
import random
import re
import socket
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
STUBS = HERE.parent / "stubs"
STEP_LINE = re.compile(r"Global step (\d+): (\{.*\})\s*$")


def build_model(tokenizer, seed: int = 0, moe: bool = False):
    """A tiny Qwen3 (or Qwen3-MoE: 4 experts, top 2) causal LM. Not stablerl.tools.demo's Qwen2: transformers 5's
    AutoTokenizer forces Qwen2Tokenizer on a ``qwen2`` checkpoint (a byte-level BPE that drops the word
    "copy" of the demo's word-level vocabulary), and trusts the saved tokenizer class for ``qwen3``."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(seed)
    common = dict(vocab_size=len(tokenizer), hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=64, tie_word_embeddings=False,
                  pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id, bos_token_id=None)
    if moe:
        model = Qwen3MoeForCausalLM(Qwen3MoeConfig(intermediate_size=128, moe_intermediate_size=64, num_experts=4,
                                                   num_experts_per_tok=2, norm_topk_prob=True, **common))
    else:
        model = Qwen3ForCausalLM(Qwen3Config(intermediate_size=128, **common))
    for key in ("pad_token_id", "eos_token_id"):
        setattr(model.generation_config, key, getattr(tokenizer, key))
    model.generation_config.bos_token_id = None
    return model


def make_assets(root: Path, n_prompts: int = 16, seed: int = 0, moe: bool = False) -> dict:
    from stablerl.tools.demo import DIGITS, build_tokenizer

    tokenizer = build_tokenizer()
    model = build_model(tokenizer, seed=seed, moe=moe)
    model_dir = root / "model"
    model.save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    rng = random.Random(seed)
    data = root / "prompts.jsonl"
    with data.open("w") as f:
        for _ in range(n_prompts):
            d = rng.choice(DIGITS)
            f.write(json.dumps({"input": f"copy {d} :", "label": d}) + "\n")
    return {"model": str(model_dir), "data": str(data), "reward": str(HERE / "copy_reward.py")}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def worker_env() -> dict:
    env = dict(os.environ)
    paths = [str(STUBS), str(HERE)] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    env.update(
        PYTHONPATH=os.pathsep.join(dict.fromkeys(paths)),
        STABLERL_CHAINED_SETUP_HOOK="orlhf_cpu.install",
        DS_ACCELERATOR="cpu", RAY_USAGE_STATS_ENABLED="0", TOKENIZERS_PARALLELISM="false",
        TORCHDYNAMO_DISABLE="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
        OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
    )
    return env


class RayCluster:
    """``ray start --head`` with its own temp dir; :meth:`stop` ends this cluster's processes only (found by that
    dir in their command line: other Ray clusters on the machine are left alone, which ``ray stop`` would not)."""

    def __init__(self, num_cpus: int = 4, num_gpus: int = 2):
        import tempfile

        self.env = worker_env()
        self.ray = str(Path(sys.executable).parent / "ray")
        self.port = _free_port()
        self.address = f"127.0.0.1:{self.port}"
        # short: Ray's socket paths under it must stay within AF_UNIX's 107 bytes
        self.temp_dir = tempfile.mkdtemp(prefix="srl-ray-", dir="/tmp")
        self.cmd = [self.ray, "start", "--head", f"--port={self.port}", f"--num-cpus={num_cpus}",
                    f"--num-gpus={num_gpus}", "--include-dashboard=false", "--disable-usage-stats",
                    f"--temp-dir={self.temp_dir}", "--node-ip-address=127.0.0.1"]

    def start(self) -> "RayCluster":
        out = subprocess.run(self.cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if out.returncode != 0:
            raise RuntimeError(f"ray start failed:\n{out.stdout}\n{out.stderr}")
        self.env["RAY_ADDRESS"] = self.address
        return self

    def pids(self) -> list:
        out = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and int(entry.name) != os.getpid():
                try:
                    cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
                except OSError:
                    continue
                if self.temp_dir in cmdline:
                    out.append(int(entry.name))
        return out

    def stop(self) -> None:
        import signal
        import time

        for sig, wait in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 2.0)):
            pids = self.pids()
            for pid in pids:
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass
            deadline = time.time() + wait
            while pids and time.time() < deadline and self.pids():
                time.sleep(0.2)
        import shutil

        shutil.rmtree(self.temp_dir, ignore_errors=True)


def launch(argv: list, env: dict, log: Path, timeout: int = 900) -> dict:
    """Run the stablerl entry point; returns rc, its output and OpenRLHF's per-step status dicts."""
    cmd = [sys.executable, "-m", "stablerl.adapters.openrlhf.train_ppo_ray", *argv]
    with log.open("w") as f:
        proc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT, text=True, timeout=timeout)
    text = log.read_text()
    steps = {}
    for line in text.splitlines():
        m = STEP_LINE.search(line)
        if m:
            steps[int(m.group(1))] = ast.literal_eval(m.group(2))
    return {"rc": proc.returncode, "output": text, "steps": steps, "cmd": cmd}


_SETTING = re.compile(r"\s(\w+)\s+= (\S+)\s+\(([^:)]+)")


def settings_table(output: str, header: str) -> dict:
    """``{name: (value, source)}`` of the effective-settings table stablerl printed after ``header``
    (e.g. ``policy loss 'entropic'``), as a Ray worker's forwarded stderr; {} when it was not printed."""
    lines = output.splitlines()
    for i, line in enumerate(lines):
        if f"stablerl/openrlhf: {header} runs with:" in line:
            table = {}
            for row in lines[i + 1:]:
                m = _SETTING.search(row)
                if m is None:
                    break
                table[m.group(1)] = (ast.literal_eval(m.group(2)), m.group(3).strip())
            return table
    return {}
