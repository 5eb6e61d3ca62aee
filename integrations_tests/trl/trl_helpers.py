"""Helpers for the TRL integration tests (imported by the test modules): real TRL 1.16 training on
CPU, nothing downloaded. The offline environment is set in conftest.py, before any import.

Run: cd /work/main && <trl-venv>/bin/python -m pytest integrations_tests/trl -q -p no:cacheprovider --import-mode=importlib
"""

import pytest  # noqa: E402

trl = pytest.importorskip("trl")
pytest.importorskip("transformers")

import torch  # noqa: E402

torch.set_num_threads(1)  # deterministic and comparable timings on small CPUs

from transformers import TrainerCallback  # noqa: E402

from stablerl.tools.demo import build_dataset, build_model, build_tokenizer, copy_reward  # noqa: E402

TOKENIZER = build_tokenizer()


def plain(value):
    """A stablerl state dict with its tensors as lists (comparable with ==, JSON-able)."""
    if isinstance(value, torch.Tensor):
        return value.tolist()
    if isinstance(value, dict):
        return {str(k): plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain(v) for v in value]
    return value


def tiny_model(seed=0, dtype=torch.float32):
    """~20k-parameter Qwen2-style model (hidden 32, 2 layers) over the demo's word-level vocabulary.

    ``dtype=torch.float64`` for parity tests: two runs of the same formula summed in a different
    order differ by ~1e-16 relative instead of ~1e-7, so Adam (which turns tiny gradient differences
    of near-zero gradients into parameter differences of order ``lr``) cannot amplify them past a
    tolerance, whatever vector kernels (AVX2, AVX-512) the CPU runs."""
    model = build_model(TOKENIZER, seed=seed, hidden_size=32, num_layers=2)
    return model.to(dtype)


def binary_digit_reward(prompts, completions, **kwargs):
    """1 if the first generated word is a digit, else 0: binary, and mixed within groups from the start
    (a random policy emits a digit ~2/3 of the time), so every algorithm gets a learning signal."""
    return [float(bool(c.split()) and c.split()[0].isdigit()) for c in completions]


def base_kwargs(tmp_path, **overrides):
    """CPU/fp32 GRPO settings; num_iterations=2 and GA=2 so that old log-probs exist and the ratio != 1."""
    kw = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        num_iterations=2,
        gradient_accumulation_steps=2,
        learning_rate=5e-3,
        lr_scheduler_type="constant",
        max_steps=2,
        logging_steps=1,
        seed=0,
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
    kw.update(overrides)
    return kw


class Recorder(TrainerCallback):
    """Per optimizer step: the logged values and a copy of every parameter."""

    def __init__(self, model):
        self.model = model
        self.logs = []
        self.params = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.logs.append(dict(logs))

    def on_step_end(self, args, state, control, **kwargs):
        self.params.append(torch.cat([p.detach().reshape(-1).clone() for p in self.model.parameters()]))


def train(trainer_cls, args, model_seed=0, reward=copy_reward, model=None, dtype=torch.float32):
    """Train ``trainer_cls`` with ``args`` on the copy task; return (trainer, recorder, initial params)."""
    model = model if model is not None else tiny_model(model_seed, dtype)
    initial = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    rec = Recorder(model)
    trainer = trainer_cls(
        model=model,
        reward_funcs=reward,
        args=args,
        train_dataset=build_dataset(64, seed=0),
        processing_class=TOKENIZER,
        callbacks=[rec],
    )
    trainer.train()
    return trainer, rec, initial


def train_recording_estimator(monkeypatch, trainer_cls, args):
    """Train ``trainer_cls`` with ``args`` and record, per generation batch, a snapshot of the generating weights
    with the batch TRL returned, and the keyword arguments of every ``stablerl.compute_advantage`` call. Returns
    (trainer, [(snapshot, batch)], [kwargs]); checks that it trained."""
    import copy

    import stablerl.api as core_api

    calls, batches = [], []
    real = core_api.compute_advantage

    def spy(estimator, **kw):
        calls.append({k: (v.detach().clone() if isinstance(v, torch.Tensor) else v) for k, v in kw.items()})
        return real(estimator, **kw)

    monkeypatch.setattr(core_api, "compute_advantage", spy)

    class Recording(trainer_cls):
        def _generate_and_score_completions(self, inputs):
            snapshot = tiny_model()
            snapshot.load_state_dict(copy.deepcopy(self.model.state_dict()))
            out = super()._generate_and_score_completions(inputs)
            batches.append((snapshot.eval(), {k: v.clone() for k, v in out.items() if isinstance(v, torch.Tensor)}))
            return out

    trainer, _, initial = train(Recording, args)
    assert len(calls) == len(batches) >= 2
    moved = torch.cat([p.detach().reshape(-1) for p in trainer.model.parameters()]) - initial
    assert moved.abs().max() > 0  # it trained
    return trainer, batches, calls


def completion_log_softmax(model, out, temperature):
    """float64 ``log_softmax(z / temperature)`` ``[n, T, V]`` of ``model`` at the positions that predict the
    completion tokens of TRL's batch ``out`` (a plain forward: the reference for what TRL's passes compute)."""
    ids = torch.cat([out["prompt_ids"], out["completion_ids"]], dim=1)
    mask = torch.cat([out["prompt_mask"], out["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits.double()
    T = out["completion_ids"].size(1)
    return (logits[:, -T - 1:-1] / temperature).log_softmax(-1)


def completion_logps(model, inp):
    """Log-probs of the completion tokens of TRL's batch ``inp`` under ``model`` (a plain forward, independent of
    TRL's code)."""
    ids = torch.cat([inp["prompt_ids"], inp["completion_ids"]], dim=1)
    mask = torch.cat([inp["prompt_mask"], inp["completion_mask"]], dim=1)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask).logits
    T = inp["completion_ids"].size(1)
    logp = torch.log_softmax(logits[:, -T - 1:-1].float(), dim=-1)
    return logp.gather(-1, inp["completion_ids"].unsqueeze(-1)).squeeze(-1)


def weights_snapshot(model):
    """The weights of ``model`` now, in a fresh tiny model (a deepcopy would keep TRL's fused-head patch, whose
    plain forward still calls the original model)."""
    import copy

    snapshot = tiny_model()
    snapshot.load_state_dict(copy.deepcopy(model.state_dict()))
    return snapshot.eval()
