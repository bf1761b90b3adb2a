"""The global mesh over every process's devices (:func:`global_mesh`) and
global arrays from host values on it (:func:`global_array`)."""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P


def global_mesh(axis_names: Sequence[str] = ("hosts", "devices")) -> Mesh:
  """A mesh over every device of every process.

  Args:
    axis_names: two names ``(slow, fast)``: shape ``(process_count,
      local_device_count)``, row ``i`` holding process ``i``'s devices, so an
      exact ``psum`` can run over the fast (in-host) axis and compression
      over the slow (cross-host) one; or one name: a flat mesh of all
      devices in process order.

  Returns:
    A ``jax.sharding.Mesh`` with Explicit axes (as ``jax.make_mesh``).

  Raises:
    ValueError: not one or two distinct names, or processes with different
      numbers of devices.
  """
  names = tuple(axis_names)
  if len(names) not in (1, 2) or len(set(names)) != len(names) or not all(
      isinstance(n, str) and n for n in names):
    raise ValueError("axis_names must be one or two distinct non-empty "
                     f"names, e.g. ('hosts', 'devices'), got {axis_names=}")
  devices = sorted(jax.devices(), key=lambda d: (d.process_index, d.id))
  counts = {}
  for d in devices:
    counts[d.process_index] = counts.get(d.process_index, 0) + 1
  if len(set(counts.values())) != 1:
    raise ValueError(f"processes have different device counts {counts}; a "
                     "('hosts', 'devices') mesh needs the same number on each")
  shape = ((len(devices),) if len(names) == 1 else
           (len(counts), len(devices) // len(counts)))
  explicit = jax.sharding.AxisType.Explicit
  return Mesh(np.asarray(devices, dtype=object).reshape(shape), names,
              axis_types=(explicit,) * len(names))


def global_array(tree, mesh: Mesh, spec: P = P(), *,
                 process_local: bool = False):
  """Global arrays from host values, on a single- or multi-process mesh.

  Each process keeps only the shards of its own devices, so this works on
  multi-process meshes (where ``jax.device_put`` of a host array needs every
  device to be addressable).

  Args:
    tree: a pytree of array-likes: identical on every process, or with
      ``process_local`` this process's part (e.g. its share of a batch).
    mesh: the (global) mesh.
    spec: partition spec for every leaf, e.g. ``P()`` for parameters or
      ``P(("hosts", "devices"))`` for a batch.
    process_local: each process holds only its own rows of the leaves
      (``jax.make_array_from_process_local_data``), not all of them.

  Returns:
    The pytree of ``jax.Array``s with ``NamedSharding(mesh, spec)``.
  """
  sharding = NamedSharding(mesh, spec)

  def put(x):
    x = np.asarray(x)
    if process_local:
      return jax.make_array_from_process_local_data(sharding, x)
    return jax.make_array_from_callback(x.shape, sharding, lambda i: x[i])

  return jax.tree.map(put, tree)
