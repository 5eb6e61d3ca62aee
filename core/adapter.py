"""The base class of every framework adapter, in the spirit of OpenTelemetry's ``BaseInstrumentor``.

A framework adapter is one small subclass::

    class VerlAdapter(FrameworkAdapter):
        name = "verl"                                   # its FrameworkSpec (register_frameworks)

        def _instrument(self, ledger, **options):        # every patch through the ledger
            ledger.set_item("policy_loss:m2po", POLICY_LOSS_REGISTRY, "m2po", make_loss("m2po"))

        @provides("old_entropy", to=(ADVANTAGE_ESTIMATOR,))
        def old_entropy(self, record): ...               # stablerl.providers

The base does what every adapter would otherwise write itself: the supported-version check (with the
``packaging`` rules of :mod:`stablerl.frameworks`; ``STABLERL_ALLOW_UNSUPPORTED=1`` makes it a warning),
idempotency (a second ``instrument()`` does nothing), restore on failure (nothing half-done stays) and on
``uninstrument()`` (the :class:`~stablerl.patching.PatchLedger` puts every original back, newest first), and
what the framework can feed (derived from the ``@provides`` methods). One instance per class and process,
as OpenTelemetry's instrumentors: ``VerlAdapter()`` always returns the same object.
"""

from __future__ import annotations

import threading
from typing import Any, ClassVar, Optional

from .frameworks import FrameworkSpec, UnsupportedVersionError, check_version, get_framework, installed_version
from .patching import PatchLedger
from .providers import Provider, collect, conditions_of, feedable_of


class FrameworkAdapter:
    """Subclass, set :attr:`name`, implement :meth:`_instrument` (and :meth:`_uninstrument` for anything the
    ledger does not hold), and mark one method per optional input it feeds with ``@provides``."""

    #: the framework's declared name (its ``FrameworkSpec.name``)
    name: ClassVar[str] = ""
    #: the error raised for an unsupported version (a subclass of UnsupportedVersionError, named for the framework)
    version_error: ClassVar[type] = UnsupportedVersionError
    #: ``(kind, input) -> Provider``, own and inherited (filled by ``__init_subclass__``)
    providers: ClassVar[dict[tuple[str, str], Provider]] = {}

    _instances: ClassVar[dict[type, "FrameworkAdapter"]] = {}
    _lock: ClassVar[threading.RLock] = threading.RLock()

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        inherited: dict[tuple[str, str], Provider] = {}
        for base in reversed(cls.__mro__[1:]):
            inherited.update(getattr(base, "providers", {}) or {})
        inherited.update(collect(vars(cls)))
        cls.providers = inherited

    def __new__(cls, *args: Any, **kwargs: Any) -> "FrameworkAdapter":
        with FrameworkAdapter._lock:
            instance = FrameworkAdapter._instances.get(cls)
            if instance is None:
                instance = super().__new__(cls)
                instance._ledger = PatchLedger(f"__stablerl_{cls.name or cls.__name__}_patch__")
                instance._instrumented = False
                instance._options = {}
                instance.version = None
                FrameworkAdapter._instances[cls] = instance
            return instance

    # -- the declaration ------------------------------------------------------------------------

    @property
    def spec(self) -> FrameworkSpec:
        """The framework's declaration (``register_frameworks``)."""
        return get_framework(self.name)

    @classmethod
    def feedable(cls) -> dict[str, frozenset]:
        """kind -> the optional inputs this adapter feeds (derived from its providers)."""
        return feedable_of(cls.providers)

    @classmethod
    def conditions(cls) -> dict[str, dict[str, str]]:
        """kind -> input -> the user setting a conditional provider needs."""
        return conditions_of(cls.providers)

    def dependencies(self) -> tuple[str, ...]:
        """The distributions and versions this adapter needs, as requirement strings (``"verl>=0.9.1,<0.10"``)."""
        spec = self.spec
        return (f"{spec.distribution}{spec.supported}",)

    def check_dependencies(self, found: Optional[str] = None, *, allow: Optional[bool] = None) -> str:
        """The installed framework's version, or :attr:`version_error` naming it and the supported range (core's
        one version policy, :func:`stablerl.frameworks.check_version`)."""
        found = found if found is not None else self.installed_version()
        return check_version(self.name, found, error=self.version_error, allow=allow)

    def installed_version(self) -> Optional[str]:
        """The framework's installed version from its distribution metadata (imports nothing), or None."""
        return installed_version(self.spec.distribution)

    # -- instrument / uninstrument -------------------------------------------------------------

    @property
    def ledger(self) -> PatchLedger:
        """Every change this adapter made to the framework, with its undo."""
        return self._ledger

    @property
    def is_instrumented(self) -> bool:
        return self._instrumented

    def instrument(self, **options: Any) -> bool:
        """Check the framework's version, then make every patch (:meth:`_instrument`). Idempotent: returns False
        when already instrumented. A failure restores what was patched before it and raises."""
        with FrameworkAdapter._lock:
            if self._instrumented:
                return False
            self.version = self.check_dependencies(allow=options.pop("allow_unsupported", None))
            try:
                self._instrument(self._ledger, **options)
            except BaseException:
                self._ledger.restore()
                self._uninstrument()
                raise
            self._instrumented, self._options = True, dict(options)
            return True

    def uninstrument(self) -> bool:
        """Undo :meth:`instrument`: the framework's own objects are back. Idempotent: False when not instrumented."""
        with FrameworkAdapter._lock:
            if not self._instrumented and not self._ledger.keys():
                return False
            self._ledger.restore()
            self._uninstrument()
            self._instrumented = False
            return True

    def _instrument(self, ledger: PatchLedger, **options: Any) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _instrument(ledger, **options)")

    def _uninstrument(self) -> None:
        """Undo what the ledger does not hold (module-level caches); the ledger is restored before this."""

    # -- inputs ---------------------------------------------------------------------------------

    def provider(self, kind: str, input_name: str) -> Optional[Provider]:
        return self.providers.get((kind, input_name))

    def provide(self, kind: str, input_name: str, record: Any) -> Any:
        """This batch's ``input_name`` for an algorithm of ``kind`` (None when the adapter has no provider, or
        this batch has none)."""
        provider = self.providers.get((kind, input_name))
        return None if provider is None else provider(self, record)

    def __repr__(self) -> str:
        state = "instrumented" if self._instrumented else "not instrumented"
        return f"<{type(self).__name__} {self.name} ({state})>"


def get_adapter(name: str) -> FrameworkAdapter:
    """The adapter instance of framework ``name``: the class its declaration names (``FrameworkSpec.adapter_class``,
    ``"module:Class"``), imported on first use (this imports the adapter module, not necessarily the framework)."""
    import importlib

    spec = get_framework(name)
    if not spec.adapter_class:
        raise UnsupportedVersionError(f"framework {name!r} declares no adapter class (FrameworkSpec.adapter_class)")
    module, _, cls = spec.adapter_class.partition(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["FrameworkAdapter", "get_adapter"]
