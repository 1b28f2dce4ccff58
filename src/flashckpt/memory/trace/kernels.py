"""Fake-tensor rules for kernels whose meta function refuses what the real kernel runs.

``FakeTensorMode`` sizes each op with its meta function; a meta function that is stricter
than the kernel stops the trace of a step the user can run. :class:`KernelRules` (a
``TorchDispatchMode`` entered inside the fake mode) answers those ops itself, with the
output the real kernel returns, and passes every other op through unchanged:

* ``aten._grouped_mm`` (``torch.nn.functional.grouped_mm``; transformers' default expert
  kernel for MoE models). Its meta function mirrors the CUDA fast path and accepts only bf16,
  but the kernel also runs fp32 and fp16 (a loop of matmuls on CPU and on CUDA without bf16);
  under autocast the experts' fp32 weights make transformers call it with fp32 inputs (it is
  not on autocast's lists). The output has the inputs' dtype (or ``out_dtype``) and the shape
  of the grouped product, which is what is allocated.

* ``aten._local_scalar_dense`` (``.item()``, ``float(t)``, ``.tolist()``): a fake tensor has
  no value. Inside :meth:`KernelRules.concrete_scalars` (the trace's optimizer steps) the read
  returns 1 (``1.0``, ``True``) and the step goes on: an optimizer reads scalars to scale its
  update (``torch.optim.Adafactor``: the step count and parameter and update norms), and what
  it allocates has its parameters' shapes whatever the value. Anywhere else (the model's
  forward and backward, where a value may decide a shape) the read stops the trace, and the
  estimate names the line that made it.

The rules size the same kernel the user runs, in the dtype it runs in; they never swap one
kernel for another.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

log = logging.getLogger(__name__)

_aten = torch.ops.aten


def grouped_mm_output_shape(
    mat_a: torch.Tensor, mat_b: torch.Tensor, offs: torch.Tensor | None
) -> list[int]:
    """The output shape of ``_grouped_mm`` (2D/3D operands, as the kernel defines it)."""
    a2, b2 = mat_a.dim() == 2, mat_b.dim() == 2
    if a2 and b2:
        if offs is None:
            raise RuntimeError("grouped_mm of two 2D operands needs offs")
        return [offs.size(0), mat_a.size(0), mat_b.size(1)]
    if a2:
        return [mat_a.size(0), mat_b.size(-1)]
    if b2:
        return [mat_a.size(1), mat_b.size(1)]
    return [mat_a.size(0), mat_a.size(1), mat_b.size(-1)]


def _grouped_mm(
    func: Any,
    mat_a: torch.Tensor,
    mat_b: torch.Tensor,
    offs: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    if mat_a.dtype == torch.bfloat16 and mat_b.dtype == torch.bfloat16:
        return func(mat_a, mat_b, offs=offs, bias=bias, out_dtype=out_dtype)  # type: ignore[no-any-return]
    if mat_a.dtype != mat_b.dtype:
        raise RuntimeError(
            f"grouped_mm: mat_a is {mat_a.dtype} and mat_b is {mat_b.dtype}; the kernel "
            "needs one dtype"
        )
    if bias is not None:
        raise RuntimeError("grouped_mm: bias is not supported by the kernel")
    shape = grouped_mm_output_shape(mat_a, mat_b, offs)
    return torch.empty(shape, dtype=out_dtype or mat_a.dtype, device=mat_a.device)


class KernelRules(TorchDispatchMode):
    """Answer the ops listed in the module docstring as their real kernels do (fake tensors)."""

    def __init__(self) -> None:
        super().__init__()
        self.scalars_ok = False
        self.scalar_reads = 0

    @contextlib.contextmanager
    def concrete_scalars(self) -> Iterator[None]:
        """Within the block a scalar read of a fake tensor returns 1 (see the module doc)."""
        before, self.scalars_ok = self.scalars_ok, True
        try:
            yield
        finally:
            self.scalars_ok = before

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is _aten._grouped_mm.default:
            return _grouped_mm(func, *args, **kwargs)
        if func is _aten._local_scalar_dense.default and self.scalars_ok:
            self.scalar_reads += 1
            dtype = args[0].dtype
            if dtype == torch.bool:
                return True
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        return func(*args, **kwargs)
