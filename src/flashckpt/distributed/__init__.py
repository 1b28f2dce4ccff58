"""torch.distributed support; :func:`init_process_group` is the one call meant for users.

Every rank runs the same save path on its own shards; this package makes them agree. Layers,
each importing only those before it: :mod:`.group` (where a rank sits, the Store barrier that
carries errors, node map), :mod:`.replication` (peer copies of the node-local memory tier), then
the save attempt and commit protocol (:mod:`.attempt`, :mod:`.commit`, :mod:`.merge`), ownership
of replicated tensors (:mod:`.ownership`), the distributed restore (:mod:`.restore`) and the one
object the Checkpointer talks to (:mod:`.runtime`). It may call ``engine.tiers``,
``engine.save`` and ``engine.restore``; the Checkpointer (``engine.runtime``) sits above it.
Only this package runs collectives. Beside them, :mod:`.standby` runs a job's processes on one
node: ``flashckpt run`` keeps a warm standby set of ranks that takes over, on a fresh process
group, when the active set dies.
"""

from flashckpt.distributed.group.elastic import init_process_group, restart_count

__all__ = ["init_process_group", "restart_count"]
