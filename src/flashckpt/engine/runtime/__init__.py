"""What lives as long as a Checkpointer: the facade and its lifecycle.

Owns: the public :class:`~.checkpointer.Checkpointer` and its save path (:mod:`.saving`), the one
save in flight and the error nobody has seen yet (:mod:`.inflight`), exit safety (:mod:`.exit`),
preemption (:mod:`.preempt`), the run marker and restart time (:mod:`.lifecycle`,
:mod:`.restart`), the meters (:mod:`.meter`) and ``should_save`` (:mod:`.cadence`). What the
helpers may call on the Checkpointer is :class:`~.facade.Facade`, so none of them imports it.

May call everything in :mod:`flashckpt.engine` and :mod:`flashckpt.distributed`.
"""
