"""Hook specifications: what a stablerl plugin can register.

A plugin is a module (or object) with functions decorated by :data:`hookimpl`. Built-in
plugins in ``stablerl.plugins`` and third-party packages (entry-point group ``stablerl``) use
the very same hooks. Each hook receives a ``register`` callback; call it once per algorithm::

    from stablerl import hookimpl, AlgorithmSpec, POLICY_LOSS

    @hookimpl
    def register_policy_losses(register):
        register(AlgorithmSpec(name="my_loss", kind=POLICY_LOSS, fn=my_loss, paper="2501.00001"))

``register`` also accepts keyword form: ``register(name="my_loss", fn=my_loss, ...)``; the kind
is then the hook's.
"""

import pluggy

hookspec = pluggy.HookspecMarker("stablerl")
hookimpl = pluggy.HookimplMarker("stablerl")


@hookspec
def register_policy_losses(register):
    """Register policy losses: ``fn(batch: PolicyLossBatch, params, ctx: Context) -> (loss, metrics)``."""


@hookspec
def register_advantage_estimators(register):
    """Register advantage estimators: ``fn(batch: AdvantageBatch, params, ctx) -> (advantages, returns)``."""


@hookspec
def register_aggregations(register):
    """Register loss aggregation modes beyond the built-in four."""


@hookspec
def register_reward_shapers(register):
    """Register reward shapers: transform scalar rewards before the advantage estimator."""


@hookspec
def register_batch_filters(register):
    """Register batch filters / samplers: select or mask responses and tokens."""


@hookspec
def register_controllers(register):
    """Register stateful controllers (entropy controllers): objects with ``state_dict()``."""


@hookspec
def register_trainer_hooks(register):
    """Register trainer hooks: a :class:`stablerl.contracts.TrainerHook` subclass whose instances act between
    optimizer passes over a rollout batch (``before_batch`` / ``after_pass``) or decide how many samples to
    draw per prompt (``samples_per_prompt``); ``fn`` is the class, built with the params dataclass."""


@hookspec
def register_router_families(register):
    """Register MoE router families for routing replay (see ``stablerl.routing_replay``)."""


@hookspec
def register_rollout_corrections(register):
    """Register training-inference mismatch corrections usable with any policy loss:
    ``fn(batch: PolicyLossBatch, params, ctx) -> (weights [B, T] detached, metrics)``."""


@hookspec
def register_frameworks(register):
    """Declare RL frameworks an adapter supports: ``register(stablerl.frameworks.FrameworkSpec(...))``.

    A third party adds a fourth framework this way, without touching core."""
