"""Worker for test_trl_distributed.py (2 CPU processes, gloo, under ``stablerl.testing.launch_gloo``, which
gives each torchrun's environment; Accelerate sets up the process group from it).

Trains with a stablerl loss that uses prompt groups and scores (gvpo) and a stablerl advantage
estimator, and checks on every rank that stablerl's ``grpo`` estimator (epsilon 1e-4) reproduces
TRL's own per-process advantages exactly: same gathered rewards, same groups, same slice.
"""

import math
import os

for _k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "HF_DATASETS_OFFLINE", "HF_HUB_DISABLE_TELEMETRY"):
    os.environ[_k] = "1"

import torch  # noqa: E402

torch.set_num_threads(1)

from transformers import TrainerCallback  # noqa: E402

from stablerl.adapters.trl import GRPOConfig, GRPOTrainer  # noqa: E402
from stablerl.tools.demo import build_dataset, build_model, build_tokenizer  # noqa: E402


def digit_reward(prompts, completions, **kwargs):
    return [float(bool(c.split()) and c.split()[0].isdigit()) for c in completions]


class Checked(GRPOTrainer):
    compared = 0

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        advantage_step = self._stablerl_rollout.run

        def checked(batch, out, **kw):  # the advantage step's call site
            trl_adv = out["advantages"]  # TRL's own, still in place: (n_local,)
            ours = advantage_step(batch, out, **kw)["advantages"]
            per_seq = ours.gather(1, (out["completion_mask"].sum(1, keepdim=True) - 1).clamp(min=0)).squeeze(1)
            torch.testing.assert_close(per_seq, trl_adv, rtol=1e-6, atol=1e-6)
            Checked.compared += 1
            return out

        self._stablerl_rollout.run = checked


def rank_main(rank, world, out_dir, loss_type):
    tok = build_tokenizer()
    logs = []

    class Rec(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                records.append(logs)

    records = logs
    args = GRPOConfig(
        output_dir=os.path.join(out_dir, "run"), loss_type=loss_type, advantage_estimator="grpo",
        stablerl_advantage_params={"epsilon": 1e-4}, per_device_train_batch_size=8, num_generations=4,
        max_completion_length=4, num_iterations=2, gradient_accumulation_steps=1, learning_rate=5e-3, max_steps=3,
        logging_steps=1, use_cpu=True, bf16=False, gradient_checkpointing=False, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0,
    )
    model = build_model(tok, hidden_size=32)
    before = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    trainer = Checked(model=model, reward_funcs=digit_reward, args=args, train_dataset=build_dataset(64),
                      processing_class=tok, callbacks=[Rec()])
    trainer.train()
    after = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    result = {
        "rank": trainer.accelerator.process_index,
        "world": trainer.accelerator.num_processes,
        "compared": Checked.compared,
        "losses": [log["loss"] for log in logs],
        "finite": all(math.isfinite(log["loss"]) for log in logs),
        "moved": bool(not torch.equal(before, after)),
        "metrics": sorted(k for log in logs for k in log if k.startswith("stablerl/")),
    }
    return result
