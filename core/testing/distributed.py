"""The distributed harness: :func:`launch_gloo`, the one launcher of stablerl's multi-process (gloo,
CPU) tests, and the two-rank check (several ranks equal one rank with the whole batch)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Union

import torch

from ..api import compute_advantage, get_spec
from ..contracts import POLICY_LOSS
from .batches import GROUP_ADV, GROUP_LOSS, _rows, _run_loss, advantage_batch, policy_batch
from .common import _assert_close, _fail, _fresh_ctx, _grad


class GlooLaunchError(RuntimeError):
    """A rank of :func:`launch_gloo` failed (the message has its stderr) or did not finish in time."""


def launch_gloo(target: Union[Callable, str], world_size: int = 2, args: Sequence[Any] = (), *,
                timeout: float = 120.0, init_process_group: bool = True, env: Optional[Mapping[str, str]] = None) -> list:
    """Run ``target(rank, world_size, *args)`` on ``world_size`` CPU processes; return each rank's result.

    The one launcher of stablerl's multi-process tests. Every rank is a fresh interpreter (nothing is
    forked: no inherited threads or CUDA state) with one torch thread and torchrun's environment
    (``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``)
    plus ``env``; ``sys.path`` is passed on as ``PYTHONPATH``.

    * ``target``: a module-level function, or ``"module:function"`` / ``"path/to/file.py:function"``.
      A rank imports a function's module by name, or loads it from its file when that name does not
      import there (a test module imported by pytest's ``importlib`` mode).
    * ``init_process_group``: each rank joins a gloo group (file store) before the call and leaves it
      after a final barrier. ``False``: the target (or the framework it runs, e.g. Accelerate)
      sets the group up from the environment itself.
    * ``args`` and the results travel through ``torch.save`` (tensors, numbers, containers, ...).

    Raises :class:`GlooLaunchError` naming the failed ranks with the end of their stderr, or when the
    ranks do not finish within ``timeout`` seconds (then all are killed).
    """
    if isinstance(target, str):
        location = target.rsplit(":", 1)
        if len(location) != 2:
            raise ValueError(f"target {target!r} is neither a function nor 'module:function' / 'file.py:function'")
        module, qualname = location
        file = os.path.abspath(module) if module.endswith(".py") else None
        module = None if file else module
    else:
        module, qualname = target.__module__, target.__qualname__
        file = getattr(sys.modules.get(module), "__file__", None)
    with tempfile.TemporaryDirectory(prefix="stablerl-gloo-") as tmp:
        job = os.path.join(tmp, "job.pt")
        torch.save({"module": module, "file": file, "qualname": qualname, "args": tuple(args),
                    "init": init_process_group, "store": os.path.join(tmp, "store"), "out": tmp}, job)
        with socket.socket() as sock:  # a free port for MASTER_PORT (targets that rendezvous over TCP)
            sock.bind(("127.0.0.1", 0))
            port = sock.getsockname()[1]
        base = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=os.pathsep.join(p for p in sys.path if p),
                    WORLD_SIZE=str(world_size), LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1",
                    MASTER_PORT=str(port), GROUP_RANK="0", **dict(env or {}))
        code = "import sys; from stablerl.testing.distributed import _gloo_rank_process; _gloo_rank_process(int(sys.argv[1]), sys.argv[2])"
        procs, logs = [], []
        for r in range(world_size):
            log = open(os.path.join(tmp, f"rank{r}.log"), "w+")
            logs.append(log)
            procs.append(subprocess.Popen([sys.executable, "-W", "ignore", "-c", code, str(r), job],
                                          env=dict(base, RANK=str(r), LOCAL_RANK=str(r)), stdout=log, stderr=log))
        try:
            deadline = time.monotonic() + timeout
            for r, p in enumerate(procs):
                try:
                    p.wait(timeout=max(0.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    raise GlooLaunchError(f"rank {r} of {world_size} did not finish within {timeout} s") from None
            errors = []
            for r, (p, log) in enumerate(zip(procs, logs)):
                if p.returncode != 0:
                    log.seek(0)
                    errors.append(f"rank {r} exited {p.returncode}:\n{log.read()[-3000:]}")
            if errors:
                raise GlooLaunchError("\n".join(errors))
            return [torch.load(os.path.join(tmp, f"rank{r}.pt"), weights_only=False) for r in range(world_size)]
        finally:
            for p in procs:
                if p.poll() is None:
                    p.kill()
                    p.wait()
            for log in logs:
                log.close()


def _gloo_rank_process(rank: int, job_file: str) -> None:
    """The whole life of one rank's interpreter: run :func:`_gloo_rank`, then leave at once.

    Once the result is saved and the process group is gone, the rank skips the interpreter's
    teardown (``os._exit``): a framework's C++ threads that are still joinable there (DDP's reducer,
    gloo's workers) otherwise abort the process now and then ("terminate called without an active
    exception", exit -6) after a run that succeeded. An exception still exits through Python.
    """
    _gloo_rank(rank, job_file)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _gloo_rank(rank: int, job_file: str) -> None:
    """One rank of :func:`launch_gloo` (a fresh interpreter): resolve the target, call it, save its result."""
    import importlib
    import importlib.util

    import torch.distributed as dist

    job = torch.load(job_file, weights_only=False)
    torch.set_num_threads(1)
    target = None
    if job["module"]:
        try:
            target = importlib.import_module(job["module"])
        except ImportError:
            if not job["file"]:
                raise
    if target is None or not _has_path(target, job["qualname"]):
        spec = importlib.util.spec_from_file_location("_stablerl_gloo_target", job["file"])
        target = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = target
        spec.loader.exec_module(target)
    for part in job["qualname"].split("."):
        target = getattr(target, part)
    world = int(os.environ["WORLD_SIZE"])
    if job["init"]:
        dist.init_process_group("gloo", init_method=f"file://{job['store']}", rank=rank, world_size=world)
    try:
        result = target(rank, world, *job["args"])
        torch.save(result, os.path.join(job["out"], f"rank{rank}.pt"))
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # no rank leaves while another is still in a collective
    finally:
        # The group is left explicitly, also when the target's framework (Accelerate) created it:
        # a group destroyed by the interpreter's teardown can abort a finished rank.
        if dist.is_available() and dist.is_initialized():
            dist.destroy_process_group()


def _has_path(obj: Any, qualname: str) -> bool:
    for part in qualname.split("."):
        if not hasattr(obj, part):
            return False
        obj = getattr(obj, part)
    return True


def _two_rank_data(spec, seed=0):
    return policy_batch(spec, seed=seed) if spec.kind == POLICY_LOSS else advantage_batch(spec, seed=seed, dtype=torch.float64)


def _rank_rows(spec, data, rank: int, world: int) -> slice:
    """Contiguous rows for ``rank``, cut on group boundaries."""
    B = data["response_mask"].shape[0]
    group = GROUP_LOSS if spec.kind == POLICY_LOSS else GROUP_ADV
    per = -(-(B // group) // world)
    return slice(min(B, rank * per * group), min(B, (rank + 1) * per * group))


def _two_rank_jobs(rank: int, world: int, jobs: list) -> dict[int, Any]:
    """One rank of :func:`run_two_rank` (under :func:`launch_gloo`): ``{job index: result or error}``."""
    import traceback

    import torch.distributed as dist

    from ..context import torch_distributed_context

    results: dict[int, Any] = {}
    for i, (kind, name, params) in enumerate(jobs):
        try:
            spec = get_spec(kind, name)
            data = _two_rank_data(spec)
            mask = data["response_mask"].bool()
            B = mask.shape[0]
            local = _rows(data, _rank_rows(spec, data, rank, world), B)
            ctx = torch_distributed_context(token_count=float(mask.sum()), seq_count=float(B),
                                            generator=torch.Generator().manual_seed(1234))
            if kind == POLICY_LOSS:
                loss, _, lp = _run_loss(spec, local, params, ctx=ctx)
                grad = torch.autograd.grad(loss, lp, allow_unused=True)[0] if loss.requires_grad else None
                results[i] = {"loss": loss.detach(), "grad": torch.zeros_like(lp) if grad is None else grad}
            else:
                adv, ret = compute_advantage(spec.name, ctx=ctx, **local, **params)
                results[i] = {"advantages": adv, "returns": ret}
        except Exception:  # noqa: BLE001 - reported per job by the parent
            results[i] = traceback.format_exc()
        dist.barrier()  # a job that failed on one rank must not leave the other waiting in a collective
    return results


def run_two_rank(jobs: list[tuple[str, str, Mapping[str, Any]]], world_size: int = 2, timeout: float = 120.0) -> list:
    """Run ``(kind, name, params)`` jobs on ``world_size`` gloo ranks (one launch for all jobs).

    Returns, per job, the list of per-rank results (dicts of tensors) or an error string.
    """
    jobs = [(k, n, dict(p or {})) for k, n, p in jobs]
    try:
        per_rank = launch_gloo(_two_rank_jobs, world_size, args=(jobs,), timeout=timeout)
    except GlooLaunchError as e:
        return [str(e)] * len(jobs)
    out = []
    for i in range(len(jobs)):
        failed = [r[i] for r in per_rank if isinstance(r[i], str)]
        out.append(failed[0] if failed else [r[i] for r in per_rank])
    return out


def _compare_two_rank(spec, params, results, world_size: int) -> None:
    if isinstance(results, str):
        _fail(spec, "two_rank", f"the distributed run failed:\n{results}")
    data = _two_rank_data(spec)
    if spec.kind == POLICY_LOSS:
        loss, _, lp = _run_loss(spec, data, params)
        grad = _grad(spec, "two_rank", loss, lp)
        mean_loss = sum(float(r["loss"]) for r in results) / world_size
        _assert_close(spec, "two_rank", f"mean of {world_size} rank losses vs 1-rank loss", mean_loss, loss.detach(),
                      rtol=1e-6, atol=1e-9)
        cat = torch.cat([r["grad"] for r in results]) / world_size
        _assert_close(spec, "two_rank", f"{world_size}-rank gradients / dp_size vs 1-rank gradient", cat, grad,
                      rtol=1e-6, atol=1e-9)
    else:
        adv, ret = compute_advantage(spec.name, ctx=_fresh_ctx(), **data, **params)
        _assert_close(spec, "two_rank", f"{world_size}-rank advantages vs 1-rank",
                      torch.cat([r["advantages"] for r in results]), adv, rtol=1e-6, atol=1e-9)
        _assert_close(spec, "two_rank", f"{world_size}-rank returns vs 1-rank",
                      torch.cat([r["returns"] for r in results]), ret, rtol=1e-6, atol=1e-9)


def check_two_rank_equality(name: str, kind: str = POLICY_LOSS, *, params: Optional[Mapping[str, Any]] = None,
                            world_size: int = 2, timeout: float = 120.0) -> None:
    """Two data-parallel ranks (gloo, CPU, separate processes) equal one rank with the whole batch.

    For a policy loss each rank gets half of the rows (whole groups) with
    ``torch_distributed_context`` (global token count and ``seq_count``, ``dp_size=2``); the rank
    losses averaged, and each rank's gradient divided by ``dp_size``, must equal the whole-batch
    loss and gradient (what DP gradient averaging computes). For an estimator each rank gets
    whole groups and the concatenated advantages must equal the whole-batch ones. The algorithm
    must be loadable in a fresh interpreter (an installed plugin; ``STABLERL_PLUGINS`` and
    ``sys.path`` are passed on). ``params`` must be picklable. A few seconds (two
    interpreters importing torch).
    """
    spec = get_spec(kind, name)
    params = dict(params or {})
    (results,) = run_two_rank([(kind, name, params)], world_size=world_size, timeout=timeout)
    _compare_two_rank(spec, params, results, world_size)


class _TwoRankBatch:
    """All two-rank cases of one :func:`conformance_cases` call share one spawn (run lazily, once)."""

    def __init__(self) -> None:
        self.jobs: list[tuple[str, str, dict]] = []
        self.results: Optional[list] = None

    def add(self, kind: str, name: str, params: dict) -> int:
        self.jobs.append((kind, name, params))
        return len(self.jobs) - 1

    def check(self, i: int) -> None:
        if self.results is None:
            self.results = run_two_rank(self.jobs)
        kind, name, params = self.jobs[i]
        _compare_two_rank(get_spec(kind, name), params, self.results[i], 2)
