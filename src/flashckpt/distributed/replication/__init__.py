"""Peer replication of the node-local memory tier (``replicas>=1``).

The replication thread and its rounds (:mod:`.replicate`, :mod:`.transfer`), what a node's memory
tier says was replicated (:mod:`.record`), promotion of node-local steps to the shared disk
(:mod:`.nodepromote`), and restore from surviving peers (:mod:`.peerplan`, :mod:`.peerfetch`,
:mod:`.peerrestore`).

May call: :mod:`flashckpt.distributed.group`, ``store``, ``state``, ``policy``, ``journal``.
"""
