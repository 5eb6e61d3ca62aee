"""The verl adapter's one patch ledger: every change it makes to verl (registry entries, the wrapped call
sites, the engine and trainer patches, the post-import hooks) is recorded here, and
``stablerl.adapters.verl.uninstrument()`` puts every original back (see :mod:`stablerl.adapters._patching`)."""

from stablerl.adapters._patching import PatchLedger

LEDGER = PatchLedger("_stablerl_verl_patch")
