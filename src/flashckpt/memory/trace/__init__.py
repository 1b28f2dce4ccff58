"""The traced path: one real training step run on fake tensors, live bytes accounted per phase
(:mod:`.traced`, :mod:`.livebytes`), CUDA's attention-kernel and autocast choices on CPU
(:mod:`.cudarules`; it does not model the caching allocator's rounding), fake rules for kernels
whose meta function refuses what the kernel runs (:mod:`.kernels`: grouped_mm, an optimizer's
scalar reads) and the measurement of a real ``nn.Module`` setup (:mod:`.measure`). Pure: no
threads, no device.
"""
