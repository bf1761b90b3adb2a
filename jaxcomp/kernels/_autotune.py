"""Which implementation of a kernel op runs: ``"pallas"`` or ``"xla"``."""

from __future__ import annotations

import jax.numpy as jnp

from . import _launch

IMPLEMENTATIONS = ("pallas", "xla")

# On an NVIDIA GPU, ``implementation=None`` takes the path that the last GPU
# measurement and the structural model agree on (H100, JAX 0.11.2; the
# command and its output are in benchmarks/results/kernels_h100_f32.txt, the
# rows in kernels_h100_f32.json). That measurement found the earlier Pallas
# sign kernel 1.8x faster than XLA at 1e8 float32 elements read in place, and
# the QSGD, int8 and top-k kernels slower than XLA at every size. The
# quantize kernels have since been rewritten to read x once
# (jaxcomp/kernels/quantize.py; the structure is tested from the CUDA export in
# tests/test_kernel_structure.py) and have not run on a GPU: no measurement
# describes them, so the default is XLA for every op until one does.
# ``SIGN_KERNEL_MIN_SIZE`` is the size from which the measured sign kernel
# paid, kept for the next measurement to confirm or move.
SIGN_KERNEL_MIN_SIZE = 1 << 22
MEASURED_PALLAS_OPS: frozenset = frozenset()  # ops whose current kernel won


def _gpu_default(op: str | None, n: int | None, dtype) -> str:
  if (op in MEASURED_PALLAS_OPS and op == "sign" and n is not None
      and n >= SIGN_KERNEL_MIN_SIZE and n % (8 * _launch.ROW) == 0
      and jnp.dtype(dtype) == jnp.float32):
    return "pallas"
  return "xla"


def resolve_implementation(implementation: str | None, *, op: str | None = None,
                           n: int | None = None, dtype=jnp.float32) -> str:
  """Returns ``"pallas"`` or ``"xla"``.

  Args:
    implementation: ``"pallas"``, ``"xla"`` or ``None``. ``None`` picks
      ``"xla"`` off NVIDIA GPUs (CPU, TPU, ROCm: Mosaic GPU kernels do not
      compile there), and on an NVIDIA GPU the path measured faster for
      ``op`` at ``n`` elements of ``dtype`` with the current kernels (none
      yet: see ``MEASURED_PALLAS_OPS``).
    op: ``"sign"``, ``"qsgd"``, ``"int8"``, ``"fp8"``, ``"topk"`` or ``"sampled_topk"``.
    n: element count of the input.
    dtype: the input's dtype.

  Raises:
    ValueError: ``implementation`` is not one of the above.
  """
  if implementation is None:
    return _gpu_default(op, n, dtype) if _launch.nvidia_gpu() else "xla"
  if implementation not in IMPLEMENTATIONS:
    raise ValueError(
        f"implementation must be one of {IMPLEMENTATIONS} or None, got "
        f"{implementation=}")
  return implementation
