"""How flashckpt touches files: the gateway (:mod:`.safeopen`: no-follow opens, ownership and
link checks), the backends a store writes through (:mod:`.backend` local, :mod:`.remote`
fsspec with :mod:`.retry`), O_DIRECT I/O (:mod:`.directio`) and bounded JSON files
(:mod:`.jsonfile`). Synchronous; never starts a thread.
"""
