"""How the ranks of one job find and talk to each other, without collectives on the training
path: where this process sits and its Store (:mod:`.context`), the leader-based barrier that
carries errors (:mod:`.barrier`), a process group that survives ``torchrun --max-restarts``
(:mod:`.elastic`), which node each rank runs on (:mod:`.nodes`), whether all ranks see the same
root (:mod:`.shared`) and the CPU priority of background threads (:mod:`.priority`).

May call: ``store``, ``errors``. Nothing else in :mod:`flashckpt.distributed`.
"""
