"""Test-only pieces of the SkyRL end-to-end run (importable in every Ray process: this folder is on PYTHONPATH).

- :func:`make_assets`: a tiny Qwen3 and a word-level tokenizer built in code (no hub download), with a chat
  template, and a prompts file in SkyRL's PromptDataset format;
- :class:`CannedGenerator`: stands in for SkyRL's vLLM-backed generator: each prompt's ``i``-th sample answers with
  a canned response, rewarded 1 when it copies the prompt's digit (so every group has different rewards);
- :class:`NoInferenceClient`: there is no inference engine to sync weights to;
- :class:`E2EExp`: SkyRL's ``BasePPOExp`` as the stablerl entry point builds it (its trainer is
  ``StableRayPPOTrainer``), with the two stand-ins above and the weight sync to the (absent) engine skipped.
"""

from __future__ import annotations

import json
from pathlib import Path

from stablerl.adapters.skyrl.main import experiment_class

CHAT = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def make_assets(root: Path, n_prompts: int = 8, seed: int = 0) -> dict:
    """The OpenRLHF end-to-end test's assets (its tiny Qwen3 and tokenizer), with a chat template and the prompts
    in SkyRL's PromptDataset format."""
    import importlib.util

    from transformers import AutoTokenizer

    spec = importlib.util.spec_from_file_location("_orlhf_harness", Path(__file__).parents[2] / "openrlhf" / "e2e"
                                                  / "harness.py")
    orlhf = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(orlhf)
    assets = orlhf.make_assets(root, n_prompts=n_prompts, seed=seed)
    tokenizer = AutoTokenizer.from_pretrained(assets["model"])
    tokenizer.chat_template = CHAT
    tokenizer.save_pretrained(assets["model"])
    rows = [json.loads(line) for line in Path(assets["data"]).read_text().splitlines()]
    with Path(assets["data"]).open("w") as f:
        for row in rows:
            f.write(json.dumps({"prompt": [{"role": "user", "content": row["input"]}], "env_class": "gsm8k",
                                "label": row["label"]}) + "\n")
    return {"model": assets["model"], "data": assets["data"]}


class CannedGenerator:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    async def generate(self, input_batch):
        tok = self.tokenizer
        prompts, out = input_batch["prompts"], {"prompt_token_ids": [], "response_ids": [], "rewards": [],
                                                  "loss_masks": [], "stop_reasons": []}
        seen: dict = {}
        for messages in prompts:
            text = messages[-1]["content"]
            digit = text.split()[1]
            i = seen[text] = seen.get(text, -1) + 1
            answer = [digit, digit] if i % 2 == 0 else ["0" if digit != "0" else "1", digit, digit][: 1 + i % 3]
            ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
            response = tok.convert_tokens_to_ids(answer) + [tok.eos_token_id]
            out["prompt_token_ids"].append(list(ids))
            out["response_ids"].append(response)
            out["rewards"].append(1.0 if answer[0] == digit else 0.0)
            out["loss_masks"].append([1] * len(response))
            out["stop_reasons"].append("stop")
        # per-trajectory environment metrics, as SkyRL's gym generator returns env.get_metrics()
        out.update(rollout_metrics={}, rollout_logprobs=None, trajectory_ids=None,
                   env_metrics=[{"correct": r == 1.0} for r in out["rewards"]])
        return out


class NoInferenceClient:
    model_name = "canned"

    async def sleep(self, *args, **kwargs):
        return None

    async def wake_up(self, *args, **kwargs):
        return None

    async def teardown(self):
        return None


class E2EExp(experiment_class()):
    def get_inference_client(self):
        return NoInferenceClient()

    def get_generator(self, cfg, tokenizer, inference_engine_client):
        return CannedGenerator(tokenizer)

    def get_trainer(self, *args, **kwargs):
        trainer = super().get_trainer(*args, **kwargs)
        build_models = trainer.build_models

        def build_models_without_engine(*a, **k):
            build_models(*a, **k)

            async def no_weight_sync(*_, **__):  # no inference engine to send the weights to
                return None

            trainer.dispatch.save_weights_for_sampler = no_weight_sync

        trainer.build_models = build_models_without_engine
        trainer.init_weight_sync_state = lambda: None  # no engine to set up a weight-sync channel with
        return trainer
