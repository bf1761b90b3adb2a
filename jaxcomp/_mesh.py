"""Mesh-axis plumbing: the one home of every helper that names, checks or
types mesh axes inside ``jax.shard_map`` / ``jax.pmap``.

Inside ``shard_map`` with ``check_vma=True`` (the default) every value has a
type that says over which manual mesh axes it *varies* (may differ per
device); the rest of it is *invariant* (identical on every device). jaxcomp
keeps per-device state (error-feedback residuals) varying and shared state
(counts, keys, PowerSGD's Q) invariant, and reads those types back to place
the state (:func:`jaxcomp.placement.init_sharded`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp._jaxcompat import varying_axes

AxisName = str | tuple[str, ...]


class PerDeviceUnchecked(UserWarning):
  """A compressed mean ran where values carry no per-device types
  (``jax.pmap``, or ``shard_map`` with ``check_vma=False``), so it could not
  check that its gradient is each device's own."""


def axes(axis_name: AxisName | list[str]) -> tuple[str, ...]:
  """``axis_name`` as a tuple of mesh axis names (a list is accepted too, as
  :func:`check_axis_name` does)."""
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


def check_axis_name(axis_name, param: str = "axis_name") -> tuple[str, ...]:
  """Validates a mesh axis name (or tuple of names) before any tracing.

  Returns:
    The names as a tuple.

  Raises:
    ValueError: ``axis_name`` is empty, not a string or tuple of non-empty
      strings, or names an axis twice; the message names ``param``.
  """
  if not isinstance(axis_name, (str, tuple, list)):
    names = ()
  else:
    names = axes(axis_name)
  if not names or not all(isinstance(a, str) and a for a in names):
    raise ValueError(
        f"{param} must be a non-empty mesh axis name or a tuple of them, got "
        f"{param}={axis_name!r}")
  if len(set(names)) != len(names):
    raise ValueError(f"{param} names an axis twice: {param}={axis_name!r}")
  return names


def bound_axes() -> tuple[str, ...]:
  """The mesh axes bound here by ``shard_map``/``pmap`` (manual axes), in
  mesh order; ``()`` outside them."""
  mesh = jax.sharding.get_abstract_mesh()
  manual = set(getattr(mesh, "manual_axes", ()) or ())
  return tuple(a for a in getattr(mesh, "axis_names", ()) if a in manual)


def check_bound(axis_name: AxisName, where: str,
                param: str = "axis_name") -> None:
  """Raises a ``NameError`` that says where to call ``where`` when an axis of
  ``axis_name`` (the parameter ``param``) is not bound by
  ``shard_map``/``pmap``, naming the axes that are bound."""
  for ax in axes(axis_name):
    try:
      lax.axis_index(ax)
    except NameError as e:
      bound = bound_axes()
      if bound:
        advice = (
            f"The enclosing shard_map/pmap binds {bound}: pass the same "
            f"axis name to jaxcomp (compressed_mean(axis_name=...)) and to "
            f"the mesh that jaxcomp.init / jaxcomp.make_train_step (or jaxcomp.compressed_value_and_grad) run over, e.g. "
            f"{param}={bound[0]!r} or a mesh with axis {ax!r}.")
      else:
        advice = (
            f"Nothing is bound here: call it inside jax.shard_map(..., "
            f"mesh=mesh) over a mesh with axis {ax!r}, or inside "
            f"jax.pmap(..., axis_name={ax!r}); jaxcomp.init and "
            "jaxcomp.make_train_step do that for you (with Flax, "
            "jaxcomp.flax.Optimizer in place of nnx.Optimizer and "
            "jaxcomp.flax.create_train_state in place of "
            "TrainState.create).")
      raise NameError(f"{where}: {param} {ax!r} is not bound. {advice}") from e


def types_track_devices(axis_name: AxisName) -> bool:
  """Whether values here carry varying types over ``axis_name``
  (``shard_map`` with ``check_vma=True``, the default); False under
  ``pmap``, whose values are all typed alike."""
  return all(a in varying_axes(lax.axis_index(a)) for a in axes(axis_name))


def axis_size(axis_name: AxisName) -> int:
  """Devices along ``axis_name`` (the product over a tuple; static), inside
  shard_map/pmap."""
  return math.prod(lax.axis_size(a) for a in axes(axis_name))


def axis_sizes(axis_name: AxisName) -> dict[str, int]:
  """``{axis: size}`` for every axis of ``axis_name``, in its order."""
  return {a: lax.axis_size(a) for a in axes(axis_name)}


def to_varying(tree, axis_name: AxisName):
  """Marks every leaf of ``tree`` varying over ``axis_name`` (a no-op where
  it already is), e.g. so that ``jax.grad`` returns per-device gradients.

  Inside ``jax.shard_map`` (``check_vma=True``, the default), where
  ``axis_name`` is bound; the values are unchanged, only their type
  (``lax.pcast(x, axes, to="varying")``).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def f(x):  # x replicated: the same on every device
    ...   print(jaxcomp.placement.varying_axes(x), jaxcomp.placement.varying_axes(
    ...       jaxcomp.placement.to_varying(x, "data")))
    ...   return x
    >>> _ = jax.jit(jax.shard_map(f, mesh=mesh, in_specs=P(),
    ...                           out_specs=P()))(jnp.zeros(()))
    frozenset() frozenset({'data'})
  """
  names = axes(axis_name)

  def cast(x):
    missing = tuple(a for a in names if a not in varying_axes(x))
    return lax.pcast(x, missing, to="varying") if missing else x

  return jax.tree.map(cast, tree)


def cond(pred, true_fun, false_fun, operand):
  """``lax.cond(pred, true_fun, false_fun, operand)`` where the branches'
  outputs may differ in the axes they vary over: each output leaf is marked
  varying over the union of both branches' axes (``lax.cond`` under
  ``shard_map`` requires equal types).

  E.g. DiLoCo across islands: the sync branch averages over ``"hosts"``
  parameters that vary over ``("hosts", "data")`` and returns an anchor
  varying over ``"data"``, while the waiting branch returns the stored,
  replicated anchor. Where the branches agree already (or outside
  ``shard_map``) this is ``lax.cond`` itself; each branch is traced once
  more to read its types.
  """
  t_out = jax.make_jaxpr(true_fun, return_shape=True)(operand)[1]
  f_out = jax.make_jaxpr(false_fun, return_shape=True)(operand)[1]
  t_leaves, treedef = jax.tree.flatten(t_out)
  f_leaves = treedef.flatten_up_to(f_out)
  union = [varying_axes(a) | varying_axes(b)
           for a, b in zip(t_leaves, f_leaves)]
  if all(varying_axes(a) == u == varying_axes(b)
         for a, b, u in zip(t_leaves, f_leaves, union)):
    return lax.cond(pred, true_fun, false_fun, operand)

  def widened(fun):
    def branch(x):
      leaves = treedef.flatten_up_to(fun(x))
      return jax.tree.unflatten(treedef, [
          to_varying(v, tuple(sorted(u))) if u else v
          for v, u in zip(leaves, union)])
    return branch

  return lax.cond(pred, widened(true_fun), widened(false_fun), operand)


def varying_zeros(shape: int | Sequence[int], axis_name: AxisName,
                  dtype=jnp.float32) -> jax.Array:
  """Zeros of ``shape`` and ``dtype`` typed varying over ``axis_name``: a
  per-device state leaf."""
  return to_varying(jnp.zeros(shape, dtype), axis_name)


def any_nonfinite(leaves, axis_name: AxisName) -> jax.Array:
  """Whether any device saw a NaN or Inf in ``leaves``: one int32 scalar
  all-reduce over every bound axis (also those beyond ``axis_name``: HSDP's
  devices before its hosts, a model axis), so that no replica skips a step
  the others take. A bool scalar, identical on every device."""
  bad = jnp.zeros((), jnp.bool_)
  for x in leaves:
    bad = bad | ~jnp.all(jnp.isfinite(x))
  everywhere = tuple(dict.fromkeys(bound_axes() + axes(axis_name)))
  return lax.psum(to_varying(bad.astype(jnp.int32), everywhere),
                  everywhere) > 0
