"""The framework contract: what every framework adapter answers, declared once per framework.

An adapter declares a :class:`FrameworkSpec` through the ``register_frameworks`` hook (the built-in
verl, TRL and OpenRLHF declarations come through the same hook as a third party's). Everything
two adapters would otherwise each write lives in core; this module gathers it under one name
(``from stablerl.frameworks import ...``), each part in its own module:

* :mod:`stablerl.framework_spec`: the declaration (:class:`FrameworkSpec`, :class:`FrameworkKey`);
* :mod:`stablerl.registry`: the declared frameworks (:func:`list_frameworks`, :func:`get_framework`) and
  :func:`load_adapter`, which imports the adapter module a declaration names (core never imports an
  adapter by name);
* :mod:`stablerl.resolve`: which algorithm a framework's config value selects, and whether the framework
  can feed its inputs;
* :mod:`stablerl.call_options`: the stablerl policy loss's call options and how a framework spells a
  stablerl key;
* :mod:`stablerl.reach`: what each framework's users can select, and the config lines that select it;
* :mod:`stablerl.settings`: hyper-parameter precedence and the effective settings of a selection;
* :mod:`stablerl.versions`: the version policy;
* :mod:`stablerl.framework_batch`: a framework's batch through a filter, a sampler and a loss's inputs.
"""

from __future__ import annotations

from .call_options import (CALL_OPTION_OF_KIND, CALL_OPTIONS, POLICY_LOSS_KIND, TOP_ENTROPY_INPUT,  # noqa: F401
                           check_call_options, dedicated_call_option, split_call_options, stablerl_key, top_entropy_on)
from .framework_batch import (FilteredBatch, GroupBatchSampler, advantages_from_scores,  # noqa: F401
                              apply_filter_result, balanced_group_partitions, check_supplied_inputs,
                              check_whole_groups, declared_inputs, loss_inputs, pending_loss_inputs)
from .framework_spec import FrameworkKey, FrameworkSpec  # noqa: F401
from .reach import (PARTIAL, REFUSED, SELECTABLE, TOP_ENTROPY_TEXT, config_lines, reach,  # noqa: F401
                    reach_conditions, reach_counts, reach_table, selectable_in, top_entropy_reach)
from .registry import get_framework, list_frameworks, load_adapter, switch_names  # noqa: F401
from .resolve import (check_inputs, check_selection, check_shaper_and_components, framework_names,  # noqa: F401
                      missing_inputs, resolve, selectable_names, why_missing)
from .settings import (FROM_FRAMEWORK_KEY, FROM_PAPER_DEFAULT, FROM_STABLERL_KEY, PRECEDENCE,  # noqa: F401
                       Setting, _LOGGED, as_params, check_framework_keys_used, effective_hyperparameters,
                       format_settings, log_effective_settings)
from .versions import (ALLOW_UNSUPPORTED_ENV, UnsupportedVersionError, check_signatures,  # noqa: F401
                       check_version, installed_version, version_in_range)
