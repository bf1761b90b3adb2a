"""The one home of what jaxcomp reads from JAX that JAX has spelled
differently between releases, so that a new JAX is met in one file.

Read here: the mesh axes a value varies over inside ``jax.shard_map``
(``manual_axis_type.varying`` of ``jax.typeof(x)``: ``.vma`` before JAX
0.10, ``.mat`` as an alias from 0.10; ``manual_axis_type`` is the name that
JAX 0.10.2, 0.11.2 and 0.12.0.1 all have, and that ``jax.ShapeDtypeStruct``
takes). Nothing here imports ``jax._src`` or reads a jaxpr's equations.
"""

from __future__ import annotations

import jax


def varying_axes(x) -> frozenset[str]:
  """The mesh axes over which ``x`` varies: a traced value inside
  ``shard_map`` (``check_vma=True``), or a ``jax.ShapeDtypeStruct`` that
  carries a manual axis type (``jax.make_jaxpr(..., return_shape=True)``'s).
  A value without one (outside ``shard_map``, under ``pmap`` or
  ``check_vma=False``) varies over nothing.
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
