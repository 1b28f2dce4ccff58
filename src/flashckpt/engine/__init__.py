"""How a checkpoint moves through time, one subpackage per stage of its life.

Read them in this order; each imports only the ones above it (tests/test_layers.py checks it):

- :mod:`engine.options`, :mod:`engine.device` -- the Checkpointer's validated options, and the
  accelerator calls (streams, events, pinned memory) behind one small object; shared by all stages.
- :mod:`engine.tiers` -- where a checkpoint rests: the tier set (memory -> local -> remote), tier
  identity and ownership, the staging arena in the memory tier, promotion, retention after a save.
- :mod:`engine.save` -- one save, capture -> plan -> stage -> persist -> commit; a ``SaveJob``
  owns everything about its save (tier, pins, manifest, errors).
- :mod:`engine.restore` -- choosing a step, reading and verifying its chunks, loading the state.
- :mod:`flashckpt.distributed` sits here: the same save and restore across ranks.
- :mod:`engine.runtime` -- the :class:`~flashckpt.engine.runtime.checkpointer.Checkpointer` facade
  and what lives as long as it does: the save path, the save in flight, exit safety, preemption,
  the run marker and restart time, meters and the save cadence.

Threads belong to this package and to :mod:`flashckpt.distributed` only.
"""
