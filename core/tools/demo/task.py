"""The demo's task and trainer ("copy the digit"), built in code: tokenizer, model, data set, reward and
TRL config. Shared by the scenarios (:mod:`stablerl.tools.demo`, :mod:`stablerl.tools.demo.mismatch`) and
used by integrations_tests/trl and benchmarks/stability."""

from __future__ import annotations

import os
from typing import Any, Optional

# Offline and quiet before anything imports huggingface_hub / transformers / trl.
for _key, _value in {
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    "HF_DATASETS_OFFLINE": "1",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "HF_HUB_DISABLE_PROGRESS_BARS": "1",
    "TOKENIZERS_PARALLELISM": "false",
    "TRANSFORMERS_VERBOSITY": "error",
    "TRL_USE_RICH": "0",
}.items():
    os.environ[_key] = _value

from stablerl.frameworks import load_adapter  # noqa: E402  (imports no framework)

DIGITS = [str(d) for d in range(10)]
VOCAB = ["<pad>", "<eos>", "<unk>", "copy", ":"] + DIGITS
# stablerl losses whose paper objective is a per-sequence mean (TRL's grpo normaliser) rather than token-mean
_PAPER_AGG_MODE = {"gspo": "seq-mean-token-mean", "sapo": "seq-mean-token-mean", "gmpo": "seq-mean-token-mean"}


def build_tokenizer():
    """A word-level tokenizer over :data:`VOCAB`, built in code (no files, no network)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<eos>", pad_token="<pad>", unk_token="<unk>", padding_side="left"
    )


def build_model(tokenizer, seed: int = 0, hidden_size: int = 128, num_layers: int = 2):
    """A tiny Qwen2-style causal LM (hidden 128, 2 layers: ~0.3M parameters), randomly initialised."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(seed)
    config = Qwen2Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    model = Qwen2ForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = None
    return model


def build_dataset(n: int = 200, seed: int = 0):
    """Prompts ``copy <d> :`` with the digit in a ``target`` column (passed to the reward)."""
    import random

    from datasets import Dataset

    rng = random.Random(seed)
    digits = [rng.choice(DIGITS) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"copy {d} :" for d in digits], "target": digits})


def copy_reward(prompts, completions, target, **kwargs) -> list[float]:
    """Fraction of generated words equal to the prompt's digit (0 for an empty completion)."""
    out = []
    for completion, digit in zip(completions, target):
        words = completion.split()
        out.append(sum(w == digit for w in words) / len(words) if words else 0.0)
    return out


def make_config(output_dir: str, loss: str, *, steps: int, seed: int, lr: float = 5e-4, num_iterations: int = 2,
                estimator: Optional[str] = None, **overrides: Any):
    """The demo's GRPOConfig: 8 prompts x 8 generations, completions <= 4 tokens, CPU, fp32."""
    trl_adapter = load_adapter("trl")
    kwargs: dict[str, Any] = dict(
        output_dir=output_dir,
        loss_type=loss,
        advantage_estimator=estimator,
        per_device_train_batch_size=64,
        num_generations=8,
        max_completion_length=4,
        num_iterations=num_iterations,
        gradient_accumulation_steps=1,
        learning_rate=lr,
        lr_scheduler_type="constant",
        max_steps=steps,
        logging_steps=1,
        seed=seed,
        beta=0.0,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        report_to="none",
        save_strategy="no",
        dataloader_num_workers=0,
        disable_tqdm=True,
        log_level="error",
    )
    stablerl_name = trl_adapter.resolve_loss_type(loss)
    if stablerl_name in _PAPER_AGG_MODE:
        kwargs["stablerl_loss_agg_mode"] = _PAPER_AGG_MODE[stablerl_name]
    kwargs.update(overrides)
    return trl_adapter.GRPOConfig(**kwargs)


def make_trainer(args, tokenizer=None, model=None, dataset=None, reward=copy_reward, callbacks=None, seed: int = 0,
                 **trainer_kwargs: Any):
    """TRL's ``GRPOTrainer`` (stablerl's) on the task; ``trainer_kwargs`` go to it (e.g. ``rollout_func``)."""
    tokenizer = tokenizer or build_tokenizer()
    model = model if model is not None else build_model(tokenizer, seed=seed)
    dataset = dataset if dataset is not None else build_dataset(seed=seed)
    trainer = load_adapter("trl").GRPOTrainer(
        model=model, reward_funcs=reward, args=args, train_dataset=dataset, processing_class=tokenizer,
        callbacks=callbacks, **trainer_kwargs,
    )
    from transformers.trainer_callback import PrinterCallback

    trainer.remove_callback(PrinterCallback)  # the demo prints its own progress and table
    return trainer


def window_mean(values: list, frac: float = 0.1, head: bool = False) -> float:
    """Mean of the last (``head``: first) ``frac`` of the non-missing ``values`` (NaN when none)."""
    values = [v for v in values if v is not None and v == v]
    if not values:
        return float("nan")
    k = max(1, int(round(len(values) * frac)))
    part = values[:k] if head else values[-k:]
    return sum(part) / len(part)


#: the versions the recorded demo runs (docs/stability/, the demo's "other seeds" lines, README) were made with
RECORDED_WITH = {"torch": "2.13.0", "transformers": "5.24.0", "trl": "1.16.0", "cpu_kernels": "AVX2"}


def environment() -> dict[str, str]:
    """This run's versions of torch, transformers and TRL, and the CPU kernels torch dispatches to (the numbers of a
    tiny RL run depend on all four: a different reduction order changes a sampled token, and then the run)."""
    import torch

    from stablerl.frameworks import installed_version

    return {"torch": torch.__version__,
            **{name: installed_version(name) or "not installed" for name in ("transformers", "trl")},
            "cpu_kernels": str(torch.backends.cpu.get_cpu_capability())}


def _release(text: str) -> str:
    return text.split("+", 1)[0]  # "2.13.0+cpu" is the 2.13.0 release


def version_lines(env: dict[str, str], recorded: dict[str, str] = RECORDED_WITH,
                  same_with: tuple[dict[str, str], ...] = ()) -> list[str]:
    """What this run used, and whether its numbers can be compared with the recorded runs'. ``same_with``: other
    releases measured to give the recorded numbers for the scenario's default arms on the recorded kernels."""
    lines = ["versions: " + ", ".join(f"{k} {v}" for k, v in env.items())]
    differ = [k for k in recorded if _release(env.get(k, "")) != recorded[k]]
    # a measured set applies when it names every differing key and the run has all of its releases
    measured = next((m for m in same_with if set(differ) <= set(m)
                     and all(_release(env.get(k, "")) == m[k] for k in m)), None)
    record = "recorded with " + ", ".join(f"{k} {recorded[k]}" for k in recorded)
    if differ and measured is not None:
        lines.append(record + "; yours (" + ", ".join(f"{k} {env.get(k)}" for k in differ) + ") were measured to "
                     "give the same numbers for the default arms: the recorded numbers apply to this machine's kernels")
    elif differ:
        lines.append(record + "; yours differ in " + ", ".join(f"{k} ({env.get(k)})" for k in differ)
                     + ": numbers will differ from the recorded ones; the verdict below is from this run")
    else:
        lines.append("same versions as the recorded runs: the recorded numbers apply to this machine's kernels")
    return lines
