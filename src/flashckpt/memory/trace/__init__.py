"""The traced path: one real training step run on fake tensors, live bytes accounted per phase
(:mod:`.traced`, :mod:`.livebytes`), CUDA caching-allocator rounding (:mod:`.cudarules`) and the
measurement of a real ``nn.Module`` setup (:mod:`.measure`). Pure: no threads, no device.
"""
