"""In-place restarts under ``torchrun --max-restarts``: a process group that survives them.

torchrun's elastic agent hosts one TCPStore for the whole job and hands it to every attempt
(``TORCHELASTIC_USE_AGENT_STORE=True``). torch's ``env://`` rendezvous then skips the per-attempt
key prefix (torch 2.13, ``torch/distributed/rendezvous.py``: "We create a new TCPStore for every
retry so no need to add prefix for each attempt" — but the static and c10d rendezvous handlers
reuse the agent's store). Gloo's full-mesh connect of the restarted ranks therefore reads the
dead attempt's addresses from the store, and ``init_process_group`` fails with
``Gloo connectFullMesh failed ... Connection refused``, before any user code runs. Reproduced
with 2 ranks and one SIGKILL: attempt 1 always failed, attempt 2 usually succeeded.

:func:`init_process_group` is ``torch.distributed.init_process_group`` with the missing prefix:
under the agent's store it connects to that store as a client and namespaces everything the
attempt writes by ``TORCHELASTIC_RESTART_COUNT``. Anywhere else it is the plain call.
"""

from __future__ import annotations

import datetime
import logging
import os
from typing import Any

from flashckpt.errors import ConfigError

log = logging.getLogger(__name__)

_DEFAULT_TIMEOUT = datetime.timedelta(minutes=30)


def init_process_group(backend: str | None = None, **kwargs: Any) -> None:
    """Initialize the default process group so that ``torchrun --max-restarts`` can restart
    this job in place; same arguments as ``torch.distributed.init_process_group``.

    Under torchrun's agent store (every torchrun launch) and without an explicit ``store=`` or
    ``init_method=``, the group rendezvouses through the agent's TCPStore under the prefix
    ``/worker/attempt_<TORCHELASTIC_RESTART_COUNT>``, so a restarted attempt never reads the
    addresses a killed attempt left behind. Otherwise this is the plain torch call.
    """
    import torch.distributed as dist

    if not _agent_store_in_use() or "store" in kwargs or "init_method" in kwargs:
        dist.init_process_group(backend, **kwargs)
        return
    rank = _env_int("RANK")
    world = _env_int("WORLD_SIZE")
    attempt = _env_int("TORCHELASTIC_RESTART_COUNT")
    timeout = kwargs.pop("timeout", None) or _DEFAULT_TIMEOUT
    for name, expected in (("rank", rank), ("world_size", world)):
        given = kwargs.pop(name, expected)
        if given != expected:
            raise ConfigError(
                f"init_process_group({name}={given}) disagrees with torchrun's environment "
                f"({name.upper()}={expected}); drop the argument"
            )
    agent = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        _env_int("MASTER_PORT"),
        world,
        is_master=False,
        timeout=timeout,
    )
    store = dist.PrefixStore(f"/worker/attempt_{attempt}", agent)
    log.debug("process group for torchrun attempt %d (rank %d of %d)", attempt, rank, world)
    dist.init_process_group(
        backend, store=store, rank=rank, world_size=world, timeout=timeout, **kwargs
    )


def restart_count() -> int:
    """How many times torchrun restarted this job in place (0 outside torchrun)."""
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") or 0)


def _agent_store_in_use() -> bool:
    return (
        os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
        and "TORCHELASTIC_RESTART_COUNT" in os.environ
        and "MASTER_ADDR" in os.environ
        and "MASTER_PORT" in os.environ
    )


def _env_int(name: str) -> int:
    raw = os.environ.get(name)
    try:
        return int(raw or "")
    except ValueError:
        raise ConfigError(
            f"torchrun's environment variable {name}={raw!r} is not an integer; launch with "
            "torchrun, or call torch.distributed.init_process_group yourself"
        ) from None
