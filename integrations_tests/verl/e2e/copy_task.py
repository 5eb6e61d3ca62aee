"""The task of the end-to-end run: stablerl's demo task ("copy the digit") as verl data.

``prepare(dir)`` writes the tiny Qwen2 of :mod:`stablerl.tools.demo` (random init, ~0.3M parameters) with
its word-level tokenizer, and a parquet of prompts in verl's RL format; :func:`compute_score` is the
reward function verl's reward manager loads (``reward.custom_reward_function.path``).
"""

from __future__ import annotations

import os
import random
import re

DATA_SOURCE = "stablerl_copy_digit"
# verl's RLHFDataset renders prompts with the chat template; the demo tokenizer has none
CHAT_TEMPLATE = "{% for message in messages %}{{ message['content'] }} {% endfor %}"


def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs) -> float:
    """Fraction of generated words equal to the prompt's digit (0 for an empty response): a random
    policy scores about 1/15, one that copies scores 1 (the demo's ``copy_reward``)."""
    # the word-level tokenizer has no decoder: verl's decode joins the words without spaces ("07:copy")
    words = _WORD.findall(solution_str)
    return sum(w == ground_truth for w in words) / len(words) if words else 0.0


_WORD = re.compile(r"copy|:|[0-9]|<unk>")


def prepare(root: str, n_train: int = 32, n_val: int = 8, seed: int = 0) -> dict[str, str]:
    import pandas as pd

    from stablerl.tools.demo import DIGITS, build_model, build_tokenizer

    model_dir = os.path.join(root, "tiny_qwen2")
    tok = build_tokenizer()
    tok.chat_template = CHAT_TEMPLATE
    # verl's agent loop picks its token builder from config.json's model_type (qwen2), and the Qwen
    # builder needs "\n" as one token and <|im_end|>: two added tokens (never sampled for reward)
    tok.add_tokens(["\n"])
    tok.add_special_tokens({"additional_special_tokens": ["<|im_end|>"]})
    build_model(tok, seed=seed).save_pretrained(model_dir)
    tok.save_pretrained(model_dir)
    rng = random.Random(seed)
    paths = {"model": model_dir}
    for split, n in (("train", n_train), ("val", n_val)):
        rows = []
        for i in range(n):
            d = rng.choice(DIGITS)
            rows.append({
                "data_source": DATA_SOURCE,
                "prompt": [{"role": "user", "content": f"copy {d} :"}],
                "ability": "copy",
                "reward_model": {"style": "rule", "ground_truth": d},
                "extra_info": {"split": split, "index": i},
            })
        paths[split] = os.path.join(root, f"{split}.parquet")
        pd.DataFrame(rows).to_parquet(paths[split])
    return paths


if __name__ == "__main__":
    import sys

    print(prepare(sys.argv[1]))
