"""verl's own trainer, ``python -m verl.trainer.main_ppo``, with stablerl selected by config keys only.

Six processes of the unmodified entry point (and one refused at start-up) on CPU (legacy trainer, ``trainer.use_v1=false``: the v1
trainer needs TransferQueue, which the verl session does not install; not tried yet), and one each of verl's
one-step-off and fully-async entry points (``verl.experimental``), with the test-only stand-ins of
``integrations_tests/verl/e2e/verl_cpu_standins.py`` (CPU platform, HF-``generate`` rollout server). Each run
exercises several stablerl features together (one process start costs most of a run's time on CPU):

* ``m2po`` (a loss with a batch statistic) + ``qae`` (estimator) + ``dynamic_sampling`` (batch filter) +
  ``adaptive_entropy`` (an entropy controller steering verl's ``entropy_coeff``);
* ``entropic`` (a loss that keeps state) + ``qae`` + ``d3s`` (a filter scheduled on verl's
  ``total_training_steps``), 2 steps, checkpoint at step 2;
* the same run resumed in a new process to step 3: step counter and EntroPIC's integral continue;
* ``a3po`` (verl's weight versions) + ``gtpo_entropy_filter`` (the old-log-prob pass's entropy at
  ``compute_advantage``); ``a3po`` with ``ppo_epochs=3`` (alpha 0 over the optimizer steps of one batch: AReaL's convention);
* ``a3po`` in verl's one-step-off trainer (``verl.experimental.one_step_off_policy.main_ppo``; its rollout replica
  in a resource pool of its own, weights sent by the stand-in ``cpu_ray`` checkpoint engine): alpha 0, 1/2, 1/2;
  and in its fully-async trainer (``fully_async_policy.fully_async_main``: rollouter, trainer, message queue): 0, 1/2;
* ``gtpo`` (a loss that takes prompt groups) at verl's default ``trainer.balance_batch=true`` with two micro-batches
  of two whole groups each; the same settings with a micro-batch that would split groups are refused at start-up;
* SFPO as a trainer hook (K=1, alpha 0.5): passes, reposition and entropy window, with ``empg`` (an estimator
  on the old-log-prob pass's entropy, selected by ``algorithm.adv_estimator`` alone);
* sampling-mask replay (top_p 0.8 rollouts, ``algorithm.rollout_correction.rollout_is=token``).

Everything is asserted from verl's file logger (``trainer.logger=[console,file]``) and console.
Real: Hydra config + validation, Ray, TaskRunner, legacy RayPPOTrainer, FSDP2 workers on gloo, the
agent loop, RLHFDataset, the reward manager with a custom reward function, verl's checkpointing.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
E2E = os.path.join(HERE, "e2e")
sys.path.insert(0, E2E)

pytest.importorskip("ray")
pytestmark = pytest.mark.skipif(not os.path.isdir("/proc"),
                                reason="the Ray clean-up finds this run's processes through /proc (Linux)")

RUN_TIMEOUT_S = int(os.environ.get("STABLERL_E2E_TIMEOUT", "900"))
TARGET_ENTROPY = 0.1  # EntroPIC's default (authors' run_entropic.sh)


def _base_overrides(data: dict, workdir: str, ray_tmp: str) -> list[str]:
    return [
        # the legacy trainer: the v1 trainer first starts TransferQueue (the verl session does not install it)
        "trainer.use_v1=false", "trainer.device=cpu", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        # one Ray "GPU" slot = one CPU training process (see verl_cpu_standins.PlatformCPU.ray_resource_name)
        "+ray_kwargs.ray_init.num_gpus=1", "ray_kwargs.ray_init.num_cpus=4",
        "+ray_kwargs.ray_init.include_dashboard=false", f"+ray_kwargs.ray_init._temp_dir={ray_tmp}",
        f"data.train_files={data['train']}", f"data.val_files={data['val']}", "data.train_batch_size=4",
        "data.max_prompt_length=8", "data.max_response_length=6", "data.dataloader_num_workers=0",
        f"actor_rollout_ref.model.path={data['model']}", "actor_rollout_ref.model.use_remove_padding=false",
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",  # no flash-attn on CPU
        "actor_rollout_ref.actor.strategy=fsdp2", "actor_rollout_ref.actor.fsdp_config.model_dtype=fp32",
        # one mini-batch of 16 responses, one micro-batch: one loss call per step
        "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16",
        "actor_rollout_ref.actor.use_kl_loss=false", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.rollout.name=hf", "actor_rollout_ref.rollout.n=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=1",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=16", "actor_rollout_ref.rollout.agent.num_workers=1",
        "algorithm.use_kl_in_reward=false",
        f"reward.custom_reward_function.path={os.path.join(E2E, 'copy_task.py')}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console,file]", "trainer.project_name=stablerl_e2e", "trainer.val_before_train=false",
        "trainer.test_freq=-1", f"trainer.default_local_dir={os.path.join(workdir, 'ckpt')}",
    ]


def _kill_ray_session(ray_tmp: str) -> None:
    """End every process of this run's Ray cluster (found by its private temp dir), nobody else's."""
    mine = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if ray_tmp.encode() in f.read():
                    mine.append(int(pid))
        except OSError:
            continue
    for pid in mine:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def run_main_ppo(tmp: str, name: str, overrides: list[str], *, refused: bool = False,
                 module: str = "verl.trainer.main_ppo") -> tuple[str, list[dict]]:
    """``python -m verl.trainer.main_ppo`` in a new process; returns its console output and the rows of
    verl's file logger (``refused``: the run must exit non-zero, e.g. refused at start-up)."""
    from copy_task import prepare

    data_marker = os.path.join(tmp, "data.json")
    if not os.path.exists(data_marker):
        with open(data_marker, "w") as f:
            json.dump(prepare(tmp), f)
    with open(data_marker) as f:
        data = json.load(f)
    ray_tmp = tempfile.mkdtemp(prefix="stablerl-verl-e2e-ray-", dir="/tmp")  # short: Ray's socket paths have a length limit
    metrics_path = os.path.join(tmp, f"{name}.jsonl")
    env = dict(os.environ)
    for key in [k for k in env if k.startswith(("RAY_ADDRESS", "VERL_", "CUDA_VISIBLE"))]:
        env.pop(key)
    env.update({
        "VERL_PLATFORM": "cpu",  # verl's platform override -> the stand-in PlatformCPU
        "VERL_ENGINE_DEVICE": "cuda",  # verl's engine-registry override: its FSDP engine is registered for cuda/npu
        "VERL_USE_EXTERNAL_MODULES": "verl_cpu_standins",  # imported by verl on every `import verl`
        "PYTHONPATH": os.pathsep.join([E2E, env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "VERL_FILE_LOGGER_PATH": metrics_path,
        "RAY_USAGE_STATS_ENABLED": "0", "RAY_enable_worker_prestart": "0", "TOKENIZERS_PARALLELISM": "false",
        "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HYDRA_FULL_ERROR": "1",
    })
    cmd = [sys.executable, "-m", module,
           *_base_overrides(data, tmp, ray_tmp), f"trainer.experiment_name={name}", *overrides]
    with open(os.path.join(tmp, f"{name}.cmd"), "w") as f:
        f.write(" ".join(cmd))
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"main_ppo ({name}) did not finish in {RUN_TIMEOUT_S}s; last output:\n{out[-6000:]}")
    finally:
        _kill_ray_session(ray_tmp)
        shutil.rmtree(ray_tmp, ignore_errors=True)
    with open(os.path.join(tmp, f"{name}.log"), "w") as f:
        f.write(out)
    if refused:
        assert proc.returncode != 0, f"main_ppo ({name}) was not refused:\n{out[-6000:]}"
        return out, []
    assert proc.returncode == 0, f"main_ppo ({name}) exited {proc.returncode} after {time.monotonic() - t0:.0f}s:\n{out[-6000:]}"
    rows = []
    if os.path.exists(metrics_path):
        with open(metrics_path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    return out, rows


@pytest.fixture(scope="module")
def workdir():
    d = tempfile.mkdtemp(prefix="stablerl-e2e-verl-")
    yield d
    if os.environ.get("STABLERL_E2E_KEEP"):
        print(f"kept {d}")
    else:
        shutil.rmtree(d, ignore_errors=True)


def _assert_steps_and_reward(rows: list[dict], steps: list[int]) -> None:
    assert [r["step"] for r in rows] == steps, [r["step"] for r in rows]
    for r in rows:
        score = r["data"]["critic/score/mean"]
        assert math.isfinite(score) and 0.0 <= score <= 1.0, (r["step"], score)
        assert r["data"]["training/global_step"] == r["step"]


ADAPTIVE_ENTROPY = [
    "actor_rollout_ref.actor.calculate_entropy=true",
    "+actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller=adaptive_entropy",
    "+actor_rollout_ref.actor.policy_loss.stablerl_entropy_controller_params={entropy_target:100.0,"
    "entropy_coef_delta:0.05}",
]


def test_m2po_qae_batch_filter_and_adaptive_entropy(workdir):
    out, rows = run_main_ppo(workdir, "m2po", [
        "actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=m2po",
        "+actor_rollout_ref.actor.policy_loss.m2_threshold=0.05",
        "algorithm.adv_estimator=qae", "+algorithm.quantile_k=0.6",
        "+algorithm.stablerl_batch_filter=dynamic_sampling",
        # a second pass over the batch: the policy has moved, so M2PO's second moment is not 0
        "actor_rollout_ref.actor.ppo_epochs=2",
        "trainer.total_training_steps=2", "trainer.save_freq=-1",
        *ADAPTIVE_ENTROPY,
    ])
    _assert_steps_and_reward(rows, [1, 2])
    # the effective settings, printed by the worker at its first loss call (Ray forwards it)
    assert "stablerl/verl: policy loss 'm2po' runs with" in out
    assert "m2_threshold" in out and "0.05" in out
    assert "stablerl/verl: advantage estimator 'qae' runs with" in out
    for r in rows:
        d = r["data"]
        # the loss's batch statistic, under verl's actor/ prefix
        assert 0.0 <= d["actor/m2po/masked_fraction"] <= 1.0
        assert math.isfinite(d["actor/m2po/m2_before"])
        if d["stablerl/filter/kept_row_frac"] > 0:  # some tokens trained: the second epoch's ratios differ from 1
            assert d["actor/m2po/m2_before"] > 0.0
        # the filter's and the estimator's metrics, logged by verl's logger in the TaskRunner
        assert 0.0 <= d["stablerl/filter/kept_row_frac"] <= 1.0, sorted(k for k in d if k.startswith("stablerl"))
        # dynamic_sampling drops groups whose rewards are all equal (advantage 0): nothing kept when all scores are 0
        if d["critic/score/max"] == 0.0:
            assert d["stablerl/filter/kept_row_frac"] == 0.0
    # adaptive_entropy: the coefficient after each step rises by delta while the entropy is below target (100), and
    # the next update runs with it (verl's ppo_loss subtracts entropy_coeff * entropy_loss)
    coefs = [r["data"]["actor/stablerl/adaptive_entropy/entropy_coef"] for r in rows]
    applied = [r["data"]["actor/stablerl/adaptive_entropy/applied_coef"] for r in rows]
    assert coefs == pytest.approx([0.05, 0.1], abs=1e-12) and applied == pytest.approx([0.0, 0.05], abs=1e-12)
    assert all(r["data"]["actor/stablerl/adaptive_entropy/active"] == 1.0 for r in rows)


def _integral_steps(rows: list[dict]) -> list[tuple[int, float, float]]:
    """(step, EntroPIC integral after the step's update, entropy measured in the step) from verl's log."""
    return [(r["step"], r["data"]["actor/entropic/integral"], r["data"]["actor/entropy"]) for r in rows]


ENTROPIC = [
    "actor_rollout_ref.actor.policy_loss.loss_mode=entropic", "actor_rollout_ref.actor.calculate_entropy=true",
    "algorithm.adv_estimator=qae", "trainer.save_freq=2",
    # d3s's N/K schedule: p = compute_advantage calls so far / the trainer's total_training_steps
    "+algorithm.stablerl_batch_filter=d3s",
    "+algorithm.stablerl_batch_filter_params.n_init=0.5", "+algorithm.stablerl_batch_filter_params.k_init=0.2",
]


def test_entropic_state_and_step_continue_after_resume_with_the_d3s_schedule(workdir):
    _, first = run_main_ppo(workdir, "entropic", [*ENTROPIC, "trainer.total_training_steps=2"])
    _assert_steps_and_reward(first, [1, 2])
    assert [r["data"]["stablerl/d3s/progress"] for r in first] == [0.0, 0.5]
    for r in first:
        d = r["data"]
        assert 0.0 <= d["stablerl/d3s/kept_token_frac"] <= 1.0 and 0.0 <= d["stablerl/d3s/kept_sample_frac"] <= 1.0
    step_dir = os.path.join(workdir, "ckpt", "global_step_2")
    assert os.path.exists(os.path.join(step_dir, "actor", "stablerl_loss_state_rank0.pt")), os.listdir(step_dir)
    assert os.path.exists(os.path.join(step_dir, "stablerl_driver_state.pt")), os.listdir(step_dir)
    # one micro-batch per step (weight 1): I_t = I_{t-1} + (H_t - target); the state lives across steps
    (s1, i1, h1), (s2, i2, h2) = _integral_steps(first)
    assert i1 == pytest.approx(h1 - TARGET_ENTROPY, abs=2e-3)
    assert i2 == pytest.approx(i1 + h2 - TARGET_ENTROPY, abs=2e-3)

    out, resumed = run_main_ppo(workdir, "entropic_resumed", [*ENTROPIC, "trainer.total_training_steps=3"])
    # a new process: verl's step counter resumes at 3, and the loss state is the checkpoint's
    _assert_steps_and_reward(resumed, [3])
    (s3, i3, h3), = _integral_steps(resumed)
    assert i3 == pytest.approx(i2 + h3 - TARGET_ENTROPY, abs=2e-3), (
        f"EntroPIC's integral did not continue from the checkpoint: {i3} vs {i2} + {h3} - {TARGET_ENTROPY}"
        f" (a fresh state gives {h3 - TARGET_ENTROPY})")
    assert abs(i3 - (h3 - TARGET_ENTROPY)) > 1.0  # the check can tell a restored state from a fresh one


ENTROPY_AT_ADVANTAGE = [
    "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.resume_mode=disable",
    "algorithm.adv_estimator=grpo",
    # verl's actor/entropy (the old-log-prob pass's, logged by the trainer) is then the mean of the per-response
    # token means, which is what gtpo_entropy_filter reports of the entropy it was given
    "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean",
]


def test_a3po_and_gtpo_entropy_filter_get_verls_versions_and_old_pass_entropy(workdir):
    """A-3PO in the legacy (synchronous) trainer: every token is of the proximal version, alpha = 0 and the
    behaviour weight 1; gtpo_entropy_filter at compute_advantage gets the old-log-prob pass's entropies, whose
    mean is verl's own actor/entropy of the step."""
    out, rows = run_main_ppo(workdir, "a3po_gtpo", [
        *ENTROPY_AT_ADVANTAGE, "actor_rollout_ref.actor.policy_loss.loss_mode=a3po",
        "+algorithm.stablerl_batch_filter=gtpo_entropy_filter",
        # the tiny model's entropies (~2.8) are above the default 0.7, which would drop every completion
        "+algorithm.stablerl_batch_filter_params.ent_threshold=10.0",
    ])
    _assert_steps_and_reward(rows, [1, 2])
    for r in rows:
        d = r["data"]
        assert d["stablerl/gtpo_filter/entropy_mean"] == pytest.approx(d["actor/entropy"], rel=1e-5), sorted(d)
        assert d["stablerl/gtpo_filter/dropped_frac"] == 0.0  # every completion penalised by 0.1 H_i, none dropped
        assert d["actor/a3po/alpha_mean"] == 0.0
        assert d["actor/behave_imp_weight"] == pytest.approx(1.0)


def test_a3po_alpha_is_zero_over_ppo_epochs(workdir):
    """A-3PO in verl's own trainer with actor.ppo_epochs=3 (one mini-batch): each batch gets 3 optimizer steps, and
    AReaL's convention keeps the policy version constant over them (it counts weight syncs to the rollout engine;
    its proximal policy, recomputed once per training step, is the behaviour policy in a synchronous trainer), so
    alpha is 0 at all three loss calls: verl logs alpha_mean 0 and behave_imp_weight 1 at every step."""
    out, rows = run_main_ppo(workdir, "a3po_epochs", [
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.policy_loss.loss_mode=a3po",
        "actor_rollout_ref.actor.ppo_epochs=3",
    ])
    _assert_steps_and_reward(rows, [1, 2])
    for r in rows:
        assert r["data"]["actor/a3po/alpha_mean"] == 0.0, r["data"]
        assert r["data"]["actor/behave_imp_weight"] == pytest.approx(1.0), r["data"]


def test_a3po_one_step_off_alpha_is_one_half(workdir):
    """A-3PO in verl's one-step-off trainer (``python -m verl.experimental.one_step_off_policy.main_ppo``, unmodified):
    the rollout replica in its own resource pool (one more Ray "GPU" slot), weights sent through the stand-in
    ``cpu_ray`` checkpoint engine (verl's default is NCCL), each step training the batch generated before its
    predecessor's update. Step 1 trains the initial weights' batch (alpha 0); from step 2 on every batch is one
    update stale: version v_theta - 2 for every token, A-3PO's alpha (v_theta - 1 - v) / (v_theta - v) = 1/2. Bypass
    mode (the one-step-off config's default) is off: it would replace the loss by verl's bypass_mode loss."""
    out, rows = run_main_ppo(workdir, "a3po_one_step_off", [
        "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
        # a trainer slot and a rollout slot; Ray's logical CPUs cover OneStepTaskRunner's num_cpus=10
        "++ray_kwargs.ray_init.num_gpus=2", "ray_kwargs.ray_init.num_cpus=20",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_ray",
        "hydra.searchpath=[pkg://verl.trainer.config]",  # its config's search path is relative to verl's repo
        "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.bypass_mode=false",
        "actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=a3po",
    ], module="verl.experimental.one_step_off_policy.main_ppo")
    _assert_steps_and_reward(rows, [1, 2, 3])
    assert [r["data"]["actor/a3po/alpha_mean"] for r in rows] == [0.0, 0.5, 0.5], [r["data"] for r in rows]
    # alpha 0: the proximal log-prob is the rollout's (behaviour weight 1); alpha 1/2: halfway to the current one
    assert rows[0]["data"]["actor/behave_imp_weight"] == pytest.approx(1.0)
    assert all(r["data"]["actor/behave_imp_weight"] != pytest.approx(1.0, abs=1e-7) for r in rows[1:])


def test_a3po_fully_async_alpha(workdir):
    """A-3PO in verl's fully-async trainer (``python -m verl.experimental.fully_async_policy.fully_async_main``,
    unmodified): rollouter and trainer are separate Ray actors, samples pass through verl's message queue, the
    trainer syncs the weights after every update (``trigger_parameter_sync_step=1``) while the rollouter keeps
    generating (``staleness_threshold=1``). The first update trains the initial weights' samples (alpha 0); the
    second trains samples generated before the first sync (verl counts them as stale), one version behind: alpha 1/2.
    ``async_training.partial_rollout=false``: a trajectory resumed on newer weights would be refused (verl does not
    say which of its tokens each version generated)."""
    out, rows = run_main_ppo(workdir, "a3po_fully_async", [
        "actor_rollout_ref.hybrid_engine=false", "rollout.nnodes=1", "rollout.n_gpus_per_node=1",
        # the trainer's and the rollouter's actors ask for num_cpus=10 each, the message queue 2
        "++ray_kwargs.ray_init.num_gpus=2", "ray_kwargs.ray_init.num_cpus=40",
        "actor_rollout_ref.rollout.checkpoint_engine.backend=cpu_ray",
        "data.train_batch_size=0", "rollout.total_rollout_steps=12", "rollout.n=4",
        "async_training.partial_rollout=false", "async_training.trigger_parameter_sync_step=1",
        "async_training.staleness_threshold=1", "async_training.require_batches=1",
        "trainer.total_training_steps=3", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "algorithm.adv_estimator=grpo", "algorithm.rollout_correction.bypass_mode=false",
        "actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig",
        "actor_rollout_ref.actor.policy_loss.loss_mode=a3po",
    ], module="verl.experimental.fully_async_policy.fully_async_main")
    trained = [r["data"] for r in rows if "actor/a3po/alpha_mean" in r["data"]]
    assert [d["actor/a3po/alpha_mean"] for d in trained] == [0.0, 0.5], trained
    assert [d["fully_async/count/current_param_version"] for d in trained] == [0.0, 1.0]
    assert trained[0]["fully_async/count/stale_trajectory_processed"] == 0 < trained[1][
        "fully_async/count/stale_trajectory_processed"]
    assert trained[0]["actor/behave_imp_weight"] == pytest.approx(1.0)
    assert trained[1]["actor/behave_imp_weight"] != pytest.approx(1.0, abs=1e-7)

SFPO_EMPG = [
    "actor_rollout_ref.actor.policy_loss._target_=stablerl.adapters.verl.StablePolicyLossConfig",
    "actor_rollout_ref.actor.calculate_entropy=true",
    # empg alone: the adapter keeps the old-log-prob pass's entropy for it (no opt-in key)
    "algorithm.adv_estimator=empg", "+algorithm.k=2.0",
    "trainer.total_training_steps=2", "trainer.save_freq=-1",
    "trainer.resume_mode=disable",  # the module's runs share trainer.default_local_dir: entropic's checkpoints are there
    "+actor_rollout_ref.actor.policy_loss.stablerl_trainer_hook=sfpo",
    "+actor_rollout_ref.actor.policy_loss.stablerl_trainer_hook_params={inner_steps:1,alpha:0.5,zscore_window:2}",
]


def test_sfpo_runs_its_passes_in_verls_trainer_with_empg(workdir):
    """verl's own main_ppo with SFPO (K=1, alpha 0.5): every step runs 2 passes of update_actor and repositions once;
    the fast pass moved the parameters the hook sees (fast_drift > 0) and the reposition moved them by
    (1 - alpha) of that (measured on the parameters); the stop rule's window holds verl's actor/entropy_loss.
    The reposition's exact numbers are checked on verl's update contract in test_trainer_hook.py; runs of this
    setup are not reproducible enough for a run-against-run reference (two identical ppo_epochs=2 runs gave
    step-2 entropies 2.762153 and 2.763503, and step-1 rollouts differ between runs).
    The advantages are empg's on the old-log-prob pass's entropy (without it the first compute_advantage raises
    MissingInputError): its settings table (k set) printed, returns == advantages."""
    out, rows = run_main_ppo(workdir, "sfpo_empg", SFPO_EMPG)
    _assert_steps_and_reward(rows, [1, 2])
    for r in rows:
        d = r["data"]
        assert d["actor/stablerl/sfpo/passes"] == 2.0 and d["actor/stablerl/sfpo/repositioned"] == 1.0, sorted(d)
        assert d["actor/stablerl/sfpo/fast_drift"] > 0.0  # the fast pass moved the parameters the hook sees
        assert d["actor/stablerl/sfpo/active"] == 1.0
        # the reposition moved the weights by (1 - alpha) of the fast pass's drift
        assert d["actor/stablerl/sfpo/reposition_shift"] == pytest.approx(0.5 * d["actor/stablerl/sfpo/fast_drift"],
                                                                          rel=1e-4)
    # the stop rule's window holds verl's actor/entropy_loss of each step's slow pass (window 2: z is +-1, or 0
    # when verl reports the same value twice, as its bf16 entropies often do on this tiny model)
    from stablerl.plugins.sfpo import entropy_zscore

    history = [r["data"]["actor/entropy_loss"] for r in rows]
    assert rows[1]["data"]["actor/stablerl/sfpo/zscore"] == pytest.approx(entropy_zscore(history, 2), abs=1e-6)
    assert "advantage estimator 'empg' runs with" in out and re.search(r"\bk\s+= 2\.0\b", out), out[-3000:]
    for r in rows:
        d = r["data"]
        assert math.isfinite(d["critic/advantages/mean"]) and d["critic/advantages/max"] > d["critic/advantages/min"]
        assert d["critic/returns/mean"] == pytest.approx(d["critic/advantages/mean"], abs=1e-6)
        assert d["critic/returns/max"] == pytest.approx(d["critic/advantages/max"], abs=1e-6)


def test_gtpo_gets_whole_prompt_groups_at_verls_default_balance_batch(workdir):
    """gtpo takes per-group quantities over the responses of each loss call: with verl's trainer.balance_batch=true
    (its default) the adapter deals out whole groups, and each of the two micro-batches of 8 responses holds 2 whole
    groups of rollout.n=4 (the loss-call check would stop the run on a split group, and it logs the count). A micro-batch
    of 6 responses would split groups: refused at start-up, in the driver, before Ray starts."""
    groups = ["actor_rollout_ref.actor.policy_loss.loss_mode=gtpo", "actor_rollout_ref.actor.calculate_entropy=true",
              "algorithm.adv_estimator=grpo",
              "trainer.total_training_steps=1",
              "trainer.save_freq=-1", "trainer.resume_mode=disable"]
    out, _ = run_main_ppo(workdir, "gtpo_split", [*groups, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6"],
                          refused=True)
    assert ("stablerl policy loss 'gtpo' takes prompt groups (index) and needs whole groups in every loss call; in "
            "verl: actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=6 is not a multiple of "
            "actor_rollout_ref.rollout.n=4") in out, out[-4000:]
    assert "ray init kwargs" not in out  # refused before Ray starts
    out, rows = run_main_ppo(workdir, "gtpo_groups", [*groups, "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8"])
    assert "trainer.balance_batch=false" not in " ".join(groups)  # verl's default balance_batch=true is on
    _assert_steps_and_reward(rows, [1])
    d = rows[0]["data"]
    assert d["actor/stablerl/prompt_groups"] == 2.0, sorted(k for k in d if "stablerl" in k)
    assert "global_seqlen/min" in d  # the balance ran (the adapter's group-aware one)
    assert math.isfinite(d["actor/pg_loss"])


def test_sampling_mask_replay_in_verls_trainer(workdir):
    """Sampling-mask replay (issue 28) in verl's own trainer: the stand-in rollout server samples with top_p 0.8 and
    returns kept-set log-probs; with +algorithm.sampling_mask_replay at its default (auto) the old-log-prob pass
    measures the kept mass and rollout_log_probs are replaced before verl's debug metrics and rollout correction see
    them, so the rollout and actor probabilities agree (same weights) while the kept mass is well below 1."""
    out, rows = run_main_ppo(workdir, "sampling_mask", [
        "trainer.total_training_steps=2", "trainer.save_freq=-1", "trainer.resume_mode=disable",
        "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.top_p=0.8",
        "actor_rollout_ref.rollout.calculate_log_probs=true",
        "algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0",
    ])
    _assert_steps_and_reward(rows, [1, 2])
    assert "stablerl/verl: sampling-mask replay on (auto: actor_rollout_ref.rollout.top_k / top_p truncate)" in out
    for r in rows:
        d = r["data"]
        assert 0.3 < d["sampling_mask/kept_mass"] < 0.99, sorted(d)
        # the same weights in rollout and actor: after the replay the probabilities agree (before, the rollout's
        # kept-set probability exceeds the actor's by the factor 1 / M)
        assert d["training/rollout_probs_diff_mean"] < 1e-3, d["training/rollout_probs_diff_mean"]
        # verl's own token IS weights (rollout_correction): 1 within noise (measured with the replay off: 0.822, the
        # kept mass; rollout_probs_diff_mean 0.014)
        assert d["rollout_corr/rollout_is_mean"] == pytest.approx(1.0, abs=0.02), d["rollout_corr/rollout_is_mean"]
