"""The one home of what jaxcomp reads from JAX that JAX has spelled
differently between releases, so that a new JAX is met in one file.

Read here: the mesh axes a value varies over inside ``jax.shard_map``
(``manual_axis_type.varying`` of ``jax.typeof(x)``: ``.vma`` before JAX
0.10, ``.mat`` as an alias from 0.10; ``manual_axis_type`` is the name that
JAX 0.10.2, 0.11.2 and 0.12.0.1 all have, and that ``jax.ShapeDtypeStruct``
takes); and a Mosaic GPU store without a transfer plan (``ref[...] = v``
before JAX 0.12, ``plgpu.store(..., optimized=False)`` from it); and
Pallas' Triton backend (``jax.experimental.pallas.triton``), deprecated in
JAX 0.11, warning at each lowering from 0.12 and to be removed: whether it
is here (:data:`pallas_triton`) and whether its lowering warns
(:func:`pallas_triton_warns`). Nothing here imports JAX's private modules or
reads a jaxpr's equations.
"""

from __future__ import annotations

from typing import Any

import jax
from jax.experimental.pallas import mosaic_gpu as plgpu


class MissingBackend:
  """Stands for a Pallas backend module that this JAX does not have: any
  attribute read raises ``ImportError`` naming the module, so that only a
  kernel that really needs the backend fails, when it is built."""

  def __init__(self, module: str):
    self.module = module

  def __getattr__(self, name: str):
    raise ImportError(
        f"{self.module} is not in this JAX (jax {jax.__version__}), so its "
        f"kernels cannot be built; use implementation='xla' (or None)")


try:
  # Pallas' Triton backend: the Triton kernels' loads, stores and compiler
  # parameters. A JAX that has removed it gets the stand-in.
  from jax.experimental.pallas import triton as _pallas_triton
  pallas_triton: Any = _pallas_triton
except ImportError:
  pallas_triton = MissingBackend("jax.experimental.pallas.triton")

# The first JAX whose Pallas Triton lowering warns, at every lowering
# ("The Pallas Triton backend is deprecated ..." , a DeprecationWarning from
# JAX's deprecation registry, id "jax-pallas-triton"): checked on 0.12.0.1;
# 0.10.2 lowers without a warning. 0.11 deprecated the backend in its
# changelog; its lowering was not checked here.
PALLAS_TRITON_WARNS_FROM = (0, 12)


def pallas_triton_present() -> bool:
  """Whether this JAX has Pallas' Triton backend."""
  return not isinstance(pallas_triton, MissingBackend)


def pallas_triton_warns() -> bool:
  """Whether lowering a Pallas Triton kernel warns on this JAX (from
  :data:`PALLAS_TRITON_WARNS_FROM`)."""
  return tuple(jax.__version_info__[:2]) >= PALLAS_TRITON_WARNS_FROM


def varying_axes(x) -> frozenset[str]:
  """The mesh axes over which ``x`` varies: a traced value inside
  ``shard_map`` (``check_vma=True``), or a ``jax.ShapeDtypeStruct`` that
  carries a manual axis type (``jax.make_jaxpr(..., return_shape=True)``'s).
  A value without one (outside ``shard_map``, under ``pmap`` or
  ``check_vma=False``) varies over nothing.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> x = jax.device_put(jnp.zeros(8), NamedSharding(mesh, P("data")))
    >>> def f(x):  # this device's block, then the sum over the devices
    ...   print(jaxcomp.placement.varying_axes(x),
    ...         jaxcomp.placement.varying_axes(jax.lax.psum(x, "data")))
    ...   return x
    >>> _ = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P("data"),
    ...                           out_specs=P("data")))(x)
    frozenset({'data'}) frozenset()
    >>> jaxcomp.placement.varying_axes(jnp.zeros(3))  # outside shard_map
    frozenset()
  """
  aval = x if isinstance(x, jax.ShapeDtypeStruct) else jax.typeof(x)
  mat = getattr(aval, "manual_axis_type", None)
  return frozenset(getattr(mat, "varying", ()) or ())


def manual_type(x):
  """The manual axis type of the traced value ``x``, to give a
  ``jax.ShapeDtypeStruct`` of an output computed from it (a Pallas kernel's,
  say) the same type: ``jax.ShapeDtypeStruct(shape, dtype,
  manual_axis_type=manual_type(x))``."""
  return jax.typeof(x).manual_axis_type


# JAX 0.12's public store with a choice of transfer plan (None before).
_PLGPU_STORE = getattr(plgpu, "store", None)


def store_unplanned(ref, value: jax.Array) -> None:
  """``ref[...] = value`` on Mosaic GPU as JAX 0.10 and 0.11 lower it for a
  ref without TMA transforms: one vector transfer per register, no
  transfer plan. JAX 0.12 lowers ``ref[...] =`` as an optimized transfer
  (and reads the old value first), which must prove that no vector crosses
  a 16-byte swizzle tile and that no bank conflicts occur; a per-row value
  stored into a column of a ``(rows, width)`` block, rows ``width`` words
  apart, has no such proof unless ``width`` divides 4
  (``TransferPlanDerivationError: Failed to prove that vector transfers
  don't cross swizzle tile boundaries``). ``plgpu.store(...,
  optimized=False)``, new in 0.12, is the old lowering. The one place that
  spells the difference."""
  if _PLGPU_STORE is None:
    ref[...] = value
  else:
    _PLGPU_STORE(ref, value, optimized=False)
