"""Whether jax-triton's ``triton_call`` lowers for CUDA here, without a GPU.

``python benchmarks/jax_triton_probe.py`` (with ``jax-triton`` and
``triton`` installed, which is not a jaxcomp dependency) exports a Triton
vector add called through ``jax_triton.triton_call`` for ``cuda``, with the
compute capability given (90, an H100 / H200) since no GPU is at hand, and
prints the custom calls of the exported module and the warnings raised, or
the error. It is the route past Pallas' Triton backend that
``docs/kernels.md`` weighs: the kernels written in Triton itself.
"""

from __future__ import annotations

import re
import sys
import traceback
import warnings

import jax
import jax.numpy as jnp

try:
  import jax_triton
  import triton
  import triton.language as tl
except ImportError as e:
  print(f"not installed: {e} (pip install jax-triton)")
  sys.exit(2)


@triton.jit
def _add_kernel(x_ptr, y_ptr, out_ptr, n, BLOCK: tl.constexpr):
  offs = tl.program_id(axis=0) * BLOCK + tl.arange(0, BLOCK)
  mask = offs < n
  x = tl.load(x_ptr + offs, mask=mask)
  y = tl.load(y_ptr + offs, mask=mask)
  tl.store(out_ptr + offs, x + y, mask=mask)


def add(x, y, block: int = 1024):
  return jax_triton.triton_call(
      x, y, kernel=_add_kernel,
      out_shape=jax.ShapeDtypeStruct(x.shape, x.dtype),
      grid=(-(-x.size // block),), n=x.size, BLOCK=block,
      compute_capability=90)


def main() -> int:
  print(f"jax {jax.__version__}, jax-triton {jax_triton.__version__}, "
        f"triton {triton.__version__}")
  x = jax.ShapeDtypeStruct((100_003,), jnp.float32)
  checks = [jax.export.DisabledSafetyCheck.custom_call("triton_kernel_call")]
  with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    try:
      exported = jax.export.export(jax.jit(add), platforms=["cuda"],
                                   disabled_checks=checks)(x, x)
    except Exception as e:  # pylint: disable=broad-except
      print("export failed:", "".join(
          traceback.format_exception_only(type(e), e)).strip())
      return 1
  calls = re.findall(r"stablehlo\.custom_call @([\w$.]+)",
                     exported.mlir_module())
  print("custom calls:", calls)
  print("warnings:", [f"{w.category.__name__}: {str(w.message)[:160]}"
                      for w in caught])
  return 0


if __name__ == "__main__":
  sys.exit(main())
