"""Worker for test_ppo_loss_dp.py: one gloo rank calling verl's real (wrapped) ppo_loss on its rows."""

import torch
import torch.distributed as dist


def batch(rows, dp_size, total_tokens, total_rows, seed=0):
    from tensordict import TensorDict
    from verl.utils import tensordict_utils as tu

    nt = lambda xs: torch.nested.as_nested_tensor(xs, layout=torch.jagged)  # noqa: E731
    g = torch.Generator().manual_seed(seed)
    P, R = [3, 2, 4, 1, 2, 3], [4, 3, 5, 2, 6, 4]
    # rows 0-2 close to on-policy, rows 3-5 far off: per-rank second moments differ from the global one
    old = [torch.randn(n, generator=g) * 0.3 - 1 for n in R]
    noise = [0.05, 0.05, 0.05, 0.8, 0.8, 0.8]
    # log_probs[t] scores token t+1: the response's values sit at positions p-1 .. p+r-2
    leaves = [(torch.cat([torch.zeros(p - 1), o + s * torch.randn(len(o), generator=g), torch.zeros(1)]))
              .requires_grad_(True) for p, o, s in zip(P, old, noise)]
    adv = [1.0, -0.5, 0.7, -1.2, 0.3, 0.9]
    fields = {
        "prompts": nt([torch.arange(P[i]) + 1 for i in rows]),
        "responses": nt([torch.arange(R[i]) + 1 for i in rows]),
        "response_mask": nt([torch.ones(R[i]) for i in rows]),
        "old_log_probs": nt([old[i] for i in rows]),
        "advantages": nt([torch.full((R[i],), adv[i]) for i in rows]),
    }
    data = TensorDict(fields, batch_size=[len(rows)])
    tu.assign_non_tensor(data, dp_size=dp_size, batch_num_tokens=total_tokens, global_batch_size=total_rows)
    return data, [leaves[i] for i in rows], sum(R), len(R)


def run(rows, dp_size, group, loss_mode, total_tokens=None, total_rows=None):
    import stablerl.adapters.verl  # noqa: F401  (what verl's entry point does)
    from verl.workers.config import FSDPActorConfig, PolicyLossConfig
    from verl.workers.utils.losses import ppo_loss

    _, _, T, N = batch(list(range(6)), 1, 0, 0)
    data, leaves, _, _ = batch(rows, dp_size, total_tokens or T, total_rows or N)
    cfg = FSDPActorConfig(strategy="fsdp", rollout_n=1, ppo_micro_batch_size_per_gpu=2,
                          policy_loss=PolicyLossConfig(loss_mode=loss_mode))
    loss, _ = ppo_loss(cfg, {"log_probs": torch.nested.as_nested_tensor(leaves, layout=torch.jagged)}, data, group)
    grads = torch.autograd.grad(loss, leaves)
    return loss.detach(), [g.detach() for g in grads]


def rank_main(rank, world, loss_mode, use_group):
    """One rank under ``stablerl.testing.launch_gloo``: rows 0-2 or 3-5, with verl's DP group or without."""
    rows = [0, 1, 2] if rank == 0 else [3, 4, 5]
    loss, grads = run(rows, world, dist.group.WORLD if use_group else None, loss_mode)
    return {"loss": loss, "grads": grads, "rows": rows}
