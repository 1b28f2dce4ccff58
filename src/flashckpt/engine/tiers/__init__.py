"""Where a checkpoint rests: the tiers (memory -> local disk -> remote), fastest first.

Owns: a tier's identity and ownership (one root, this user, mode 0700: :mod:`.identity`), how the
tiers are opened (:mod:`.build`) and recorded (:mod:`.config`), the tier set that picks a save's
tier and restores across tiers (:mod:`.tierset`), promotion to slower tiers (:mod:`.promote`,
:mod:`.tiercopy`), what follows a durable save (:mod:`.aftersave`), the staging arena kept in the
memory tier (:mod:`.arena`) and giving the memory tier's RAM back at close (:mod:`.closing`).

May call: ``store``, ``policy``, ``journal``, :mod:`flashckpt.engine.options`. Never a save job,
a restore or the Checkpointer.
"""
