"""Restore: choose the step, read and verify its chunks, load them into the live state.

Owns: "restore either loads a valid checkpoint or raises" (:mod:`.load`), parallel verified reads
scattered into target tensors (:mod:`.reader`), and read-only restore without a lock
(:mod:`.readonly`, ``flashckpt.restore``).

May call: :mod:`flashckpt.engine.tiers`, ``engine.device``, ``store``, ``state``. The distributed
restore is handed in by the caller (a :class:`~.load.DistRestore`), never imported.
"""
