"""When to save and what to keep: small, pure, composable policy objects.

Save policies (``EverySteps``, ``EverySeconds``, ``Auto``; combine with ``|`` into ``AnySave``)
decide at which steps the Checkpointer saves; retention policies (``KeepLast``, ``KeepEvery``,
``KeepAll``; combine with ``|`` into ``AnyOf``) decide which committed steps a tier keeps.
"""

from flashckpt.policy.interval import (
    CrashHistory,
    crash_history,
    estimate_mtbf_s,
    expected_waste_fraction,
    optimal_interval_s,
    young_interval_s,
)
from flashckpt.policy.retention import (
    AnyOf,
    KeepAll,
    KeepEvery,
    KeepLast,
    RetentionPolicy,
    as_retention,
)
from flashckpt.policy.save import (
    AnySave,
    Auto,
    EverySeconds,
    EverySteps,
    RunStats,
    SavePolicy,
    as_save_policy,
)

__all__ = [
    "AnyOf",
    "AnySave",
    "Auto",
    "CrashHistory",
    "EverySeconds",
    "EverySteps",
    "KeepAll",
    "KeepEvery",
    "KeepLast",
    "RetentionPolicy",
    "RunStats",
    "SavePolicy",
    "as_retention",
    "as_save_policy",
    "crash_history",
    "estimate_mtbf_s",
    "expected_waste_fraction",
    "optimal_interval_s",
    "young_interval_s",
]
