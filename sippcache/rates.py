"""Deprecated: moved to `sippcache.state.rates`.

`sippcache.rates` re-exports the public names it had, for one release, so that code written
against it keeps working meanwhile; importing it warns (`DeprecationWarning`). Import from
`sippcache.state.rates` instead (CHANGELOG.md).
"""

from __future__ import annotations

import warnings

from .state.rates import (
    ALWAYS,
    DEFAULT_MODE,
    FASTER,
    INEFFECTIVE,
    INEFFECTIVE_SHARE,
    KEEP_EVERY,
    KEPT_VERSION,
    MARGIN,
    MIN_PREFILL_TOKENS,
    MODE_ENVIRONMENT_VARIABLE,
    MODES,
    NEVER,
    PROBE,
    PROBE_EVERY,
    RATES_DIR_ENVIRONMENT_VARIABLE,
    RESTORE_PER_SERVER_SAVE,
    SLOWER,
    UNMEASURED,
    WASTED_IN_A_ROW,
    WINDOW,
    Decision,
    Measured,
    Mode,
    RestoreRates,
    mode_from_environment,
    rates_dir,
    rates_file,
)

__all__ = [
    "ALWAYS",
    "DEFAULT_MODE",
    "FASTER",
    "INEFFECTIVE",
    "INEFFECTIVE_SHARE",
    "KEEP_EVERY",
    "KEPT_VERSION",
    "MARGIN",
    "MIN_PREFILL_TOKENS",
    "MODES",
    "MODE_ENVIRONMENT_VARIABLE",
    "NEVER",
    "PROBE",
    "PROBE_EVERY",
    "RATES_DIR_ENVIRONMENT_VARIABLE",
    "RESTORE_PER_SERVER_SAVE",
    "SLOWER",
    "UNMEASURED",
    "WASTED_IN_A_ROW",
    "WINDOW",
    "Decision",
    "Measured",
    "Mode",
    "RestoreRates",
    "mode_from_environment",
    "rates_dir",
    "rates_file",
]

warnings.warn(
    "sippcache.rates is deprecated and goes in the next release: import from sippcache.state.rates",
    DeprecationWarning,
    stacklevel=2,
)
