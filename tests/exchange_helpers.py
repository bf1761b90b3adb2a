"""Test helpers for compressor-level exchanges on the 8-device mesh."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import numpy as np

import jaxcomp
from jaxcomp import collectives
from jaxcomp.placement import to_varying


def exchange_fn(mesh, comp, n, steps=1, axis="data", shape=None):
  """A jitted ``f(xs (p, n) or (steps, p, n), key) -> (means, locals,
  state)`` running the compressor's default collective ``steps`` times on a
  bucket of one tensor of ``shape`` (default ``(n,)``), the state
  initialised with ``key`` and step ``t`` keyed ``fold_in(key, t)``.

  ``means`` is ``(steps, n)`` (identical on every device), ``locals`` is
  ``(p, steps, n)`` (each device's contribution), ``state`` the final
  exchange state with a leading device axis.
  """
  coll = collectives.get(None, comp)
  shapes = (shape or (n,),)

  def body(xs, key):
    xs = xs[0] if xs.ndim == 2 else xs[:, 0]
    xs = xs.reshape(steps, n)
    state = coll.init_state(comp, shapes, key, axis)
    means, locs = [], []
    for t in range(steps):
      k = coll.device_key(comp, jax.random.fold_in(key, t), axis)
      (m,), (l,), state = coll.exchange(comp, (xs[t],), shapes, key=k,
                                        step=jnp.int32(t), axis_name=axis,
                                        state=state)
      means.append(m)
      locs.append(l)
    state = jax.tree.map(lambda a: a[None], to_varying(state, axis))
    return jnp.stack(means), jnp.stack(locs)[None], state

  f = jax.jit(jax.shard_map(
      body, mesh=mesh, in_specs=(P(axis) if steps == 1 else P(None, axis),
                                 P()),
      out_specs=(P(), P(axis), P(axis))))

  def run(xs, key):
    spec = P(axis) if xs.ndim == 2 else P(None, axis)
    return f(jax.device_put(xs, NamedSharding(mesh, spec)), key)

  return run


def exchange_traffic(collective, comp, n, p=8, axis="data"):
  """The traffic (``jaxcomp.collective_traffic``) of the compiled program of
  one ``collective.exchange_buffer`` of ``comp`` on an ``n``-element buffer,
  under ``jax.shard_map`` on a mesh of the first ``p`` devices."""
  mesh = jax.sharding.Mesh(np.array(jax.devices()[:p]), (axis,))

  def f(x):
    return collective.exchange_buffer(comp, x, jax.random.key(0), axis,
                                      collective.init_buffer(comp, n, axis))[0]

  x = jax.device_put(jnp.ones((p * n,)), NamedSharding(mesh, P(axis)))
  return jaxcomp.collective_traffic(jax.jit(jax.shard_map(
      f, mesh=mesh, in_specs=P(axis), out_specs=P())).lower(x).compile())
