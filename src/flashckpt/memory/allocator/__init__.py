"""The CUDA caching allocator: preallocation and allocator settings (:mod:`.prealloc`) and the
per-phase monitor that adjusts them (:mod:`.monitor`).
"""
