"""``should_save(step)``: the save policy's decision for one step, measured as it goes.

Each call ticks the run marker and the step-time meter, asks the policy, and journals the
interval it chose. Under torch.distributed rank 0 decides whenever the ranks could disagree
(clock-based policies, and SIGTERM arriving at each rank at its own step).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from flashckpt.errors import ConfigError
from flashckpt.policy.save import step_based

if TYPE_CHECKING:
    from flashckpt.engine.runtime.facade import Facade
    from flashckpt.engine.runtime.lifecycle import RunMarker
    from flashckpt.engine.runtime.meter import RunMeter
    from flashckpt.engine.runtime.preempt import Preemption


def decide(
    ckpt: Facade,
    step: int,
    meter: RunMeter,
    marker: RunMarker,
    dist: Any,
    preempt: Preemption | None,
) -> bool:
    """True when ``ckpt``'s save policy says ``step`` (just completed) should be saved."""
    if ckpt.save_policy is None:
        raise ConfigError(
            "should_save() needs a save policy: Checkpointer(..., save_policy=100) saves every "
            "100 steps; flashckpt.policy.Auto(mtbf_s=...) picks the interval from measurements"
        )
    policy = ckpt.save_policy
    # under torch.distributed, rank 0 decides whenever the ranks could disagree: clock-based
    # policies, and preemption (each rank receives SIGTERM at its own step)
    agree = dist is not None and (preempt is not None or not step_based(policy))
    if not agree and preempt is not None and preempt.at_should_save(ckpt, step):
        return True
    now = time.time()
    marker.tick(step)
    step_time = meter.tick(step, now)
    if step_time is not None and meter.journal_due():
        ckpt.journal.append("step_time", step=step, seconds=step_time)
    stats = meter.stats(step, now)
    if agree and dist is not None:
        if preempt is not None:
            preempt.last_step = step
        stop = preempt is not None and preempt.triggered  # only rank 0's counts
        verdict = dist.verdict(step, stop=stop, save=lambda: policy.should_save(stats))
        if verdict == "preempt" and preempt is not None:
            return preempt.follow(ckpt, step)
        decision = verdict == "save"
    else:
        decision = policy.should_save(stats)
    info = policy.take_decision()
    if info:
        ckpt.journal.append("interval", **info)
    return decision
