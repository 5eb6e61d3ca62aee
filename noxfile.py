"""One session per environment: verl, TRL, OpenRLHF and SkyRL need different transformers versions.

    nox                 # the whole suite (what README's test command and CI run)
    nox -s unit         # torch-only unit tests of core and every plugin
    nox -s unit_newest_torch  # the same under torch 2.14.1 (its clamp gradient rule is 2.15's, not 2.13's)
    nox -s verl         # integration tests against the real verl 0.9.1
    nox -s trl          # TRL 1.16 adapter, real CPU training, demo smoke test, MoE routing replay
    nox -s openrlhf     # OpenRLHF 0.11.2 adapter: parity with its real PolicyLoss / estimators, CLI, a Ray worker,
                        # and its entry point end to end (test_openrlhf_e2e.py: 3 runs of 2 GRPO steps in a local Ray cluster)
    nox -s skyrl        # SkyRL 0.3.0 adapter: registries, refusals, parity, and SkyRL's real trainer end to end on CPU
    nox -s parity       # the cross-framework parity matrix from the four sessions' results -> docs/parity-matrix.md
"""

import nox

nox.options.sessions = ["unit", "unit_newest_torch", "verl", "trl", "openrlhf", "skyrl", "parity"]  # parity last: it reads the others' results
nox.options.reuse_existing_virtualenvs = True

TORCH = "torch==2.13.0"  # the CPU build; frameworks' extras would pull CUDA builds
# the newest torch that lies on CI's disk (a CUDA build, run on the CPU; no download). torch 2.14 changed
# clamp's gradient at its bounds, which stablerl's closed-form backwards must follow; 2.15.0, what pip gives a
# new user today, has 2.14's rule (measured: the unit suite and TRL's integration tests pass under it)
TORCH_NEWEST = "torch==2.14.1"
PYTEST = ["pytest", "-q", "-p", "no:cacheprovider", "--import-mode=importlib"]


def _unit_tests(session, torch_pin: str) -> None:
    session.install(torch_pin)
    session.install("-e", ".[test]")
    session.run(*PYTEST, "tests", *session.posargs)


@nox.session
def unit(session):
    _unit_tests(session, TORCH)


@nox.session
def unit_newest_torch(session):
    _unit_tests(session, TORCH_NEWEST)


@nox.session
def verl(session):
    session.install(TORCH)
    # never verl's extras (they pin torch 2.11); the few modules its trainer imports on CPU
    session.install("verl==0.9.1", "cachetools", "uvicorn", "fastapi")
    session.install("-e", ".[test]")
    session.install("./examples/plugin-template")
    # includes test_main_ppo_e2e.py: six runs of `python -m verl.trainer.main_ppo` on CPU (Ray, FSDP2 on gloo,
    # test-only CPU platform + HF rollout stand-ins), each exercising several stablerl features, and one refused
    # at start-up. Measured on a 2-core Intel Xeon: the five runs before the group-keeping one took 5 min with the
    # machine otherwise quiet; the whole verl session 7.5 min, 15 min while other jobs ran
    session.run(*PYTEST, "integrations_tests/verl", "integrations_tests/template", *session.posargs)


@nox.session
def trl(session):
    session.install(TORCH)
    session.install("trl==1.16.0", "transformers==5.24.0", "matplotlib", "tqdm")
    session.install("-e", ".[test]")
    session.install("./examples/plugin-template")
    session.run(
        *PYTEST, "integrations_tests/trl", "integrations_tests/moe", "integrations_tests/template", *session.posargs,
        env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "HF_HUB_DISABLE_TELEMETRY": "1"},
    )


@nox.session
def openrlhf(session):
    session.install(TORCH)
    # OpenRLHF's wheel without its GPU pins (flash-attn, vllm, bitsandbytes); the real modules its
    # loss, experience maker, actor trainer and CLI import on CPU. flash_attn's padding helpers and
    # vLLM's engine classes are import stand-ins under integrations_tests/openrlhf/stubs (tests only); the
    # end-to-end test also runs their HF-generate engine and a CPU shim for OpenRLHF's torch.cuda calls.
    session.install("--no-deps", "openrlhf==0.11.2")
    session.install("transformers==5.15.0", "peft", "pylatexenc", "ray==2.55.0", "aiohttp", "torchdata", "pillow", "datasets")
    session.install("setuptools", "wheel")
    session.install("--no-build-isolation", "deepspeed==0.19.6")  # an sdist; builds no op on CPU
    session.install("-e", ".[test]")
    session.run(
        *PYTEST, "integrations_tests/openrlhf", *session.posargs,
        # TORCHDYNAMO_DISABLE: OpenRLHF torch.compile's its entropy (models/utils.py); on CPU, Inductor's generated
        # kernel depends on the vector ISA, and under ATEN_CPU_CAPABILITY=avx2 on an AVX-512 CPU it returns wrong
        # entropies (3.45 and 0.002 where eager gives 4.14): the suite must not depend on the CPU's kernels
        env={"DS_ACCELERATOR": "cpu", "RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false",
             "TORCHDYNAMO_DISABLE": "1"},
    )


@nox.session
def skyrl(session):
    session.install(TORCH)
    # SkyRL's wheel without its GPU pins (vllm, flash-attn, jax, the CUDA torch of its fsdp extra); the modules its
    # trainer, FSDP workers and config import on CPU, at the versions it pins (transformers <= 5.8.0, ray 2.56.0).
    # On Python 3.11 skyrl/tinker/types.py needs typing_extensions.TypedDict and model_wrapper.py imports
    # flash_attn.bert_padding at module top: test-only shims in integrations_tests/skyrl/stubs (sitecustomize).
    session.install("--no-deps", "skyrl==0.3.0", "skyrl-gym==0.4.0")
    session.install("transformers==5.8.0", "peft==0.18.1", "ray==2.56.0", "datasets", "pillow", "rich", "safetensors",
                    "tokenizers", "typer", "cloudpathlib", "loguru", "tqdm", "hydra-core==1.3.2", "omegaconf",
                    "accelerate", "torchdata", "tensordict", "jaxtyping", "cloudpickle", "aiohttp", "func_timeout",
                    "pandas")
    session.install("-e", ".[test]")
    # includes test_skyrl_e2e.py: two runs of the entry point (SkyRL's RayPPOTrainer, its FSDP policy worker on
    # gloo via a CPU shim, a canned generator in place of vLLM): one step and a checkpoint, then the resume
    session.run(
        *PYTEST, "integrations_tests/skyrl", *session.posargs,
        env={"RAY_USAGE_STATS_ENABLED": "0", "TOKENIZERS_PARALLELISM": "false", "TORCHDYNAMO_DISABLE": "1",
             "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"},
    )


@nox.session
def parity(session):
    """The cross-framework parity matrix: compares the verl / TRL / OpenRLHF / SkyRL sessions' results
    (build/parity/, or $STABLERL_PARITY_DIR) and writes docs/parity-matrix.md (`-- --check`: fail if
    the committed page differs instead of writing it)."""
    session.install(TORCH, "numpy", "pytest")  # numpy: torch warns without it
    session.run(*PYTEST, "integrations_tests/parity")  # the comparison's own tests (seconds)
    session.run("python", "integrations_tests/parity/parity_report.py", *session.posargs)
