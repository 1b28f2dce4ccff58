"""Warm standby: a second copy of the training script that waits, everything built, inside
``Checkpointer.restore()`` and takes over from the memory tier when the active process dies.

Owns: the contract between the launcher and a standby (:mod:`.role`: the environment it is
started with, the takeover message on its pipe), the standby's side of the wait (:mod:`.wait`:
idle CPU priority, prewarming, waiting for the message and for the dead writer's lock), the
deferred move of modules to their device (:mod:`.placement`) and the launcher that supervises
the active process (or ranks) and its standby (:mod:`.supervise`, :mod:`.procs`).

May call: :mod:`flashckpt.store.lock` (a read-only probe of the writer lock), the journal, and
nothing above the engine's stages (the Checkpointer calls in; this package never calls it).
"""
