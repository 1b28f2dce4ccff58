"""One save: capture -> plan -> stage -> persist -> commit.

Owns: the state of one save (its tier, pins, manifest and errors live on its
:class:`~.job.SaveJob`, never on the Checkpointer), the rule that a step is saved once
(:mod:`.steps`), the staging pool and its budget (:mod:`.staging`), chunk layout and device
fingerprints (:mod:`.layout`, :mod:`.fingerprint`), the chunk ledger (:mod:`.ledger`), the manifest
a job commits (:mod:`.manifests`), the optimizer hooks that let staging overlap training
(:mod:`.hooks`), the two futures a caller holds (:mod:`.handle`) and the first-save warm-up
(:mod:`.warmup`); device chunks staged per device, each on its own device's side stream after
its own device's event (:mod:`.devstage`, :class:`~.context.SideStreams`).

May call: :mod:`flashckpt.engine.tiers`, ``engine.options``/``engine.device``, ``store``, ``state``.
"""
