"""Shared test helpers: run compressed_mean on stacked per-device gradients."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp


def stacked(tree, mesh, axis="data"):
  """Puts a pytree whose leaves have a leading device axis onto the mesh."""
  return jax.device_put(tree, NamedSharding(mesh, P(axis)))


def sharded_update(tx, params, mesh, axis="data"):
  """``tx.update`` under ``jax.shard_map``, for per-device gradients.

  Returns ``(f, state, specs)``: ``f(grads, state) -> (updates, state)`` is
  jitted, takes gradients whose leaves have a leading device axis (sharded
  over ``axis``, e.g. by :func:`stacked`) and returns replicated updates and
  the state's global view; ``state`` is ``tx``'s initial state for
  ``params``.
  """
  state, specs = jaxcomp.init_sharded(tx, params, mesh, axis)

  def body(g, s):
    u, s = tx.update(jax.tree.map(lambda x: x[0], g), jaxcomp.to_local(s, specs))
    return u, jaxcomp.to_global(s, specs)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), specs),
                            out_specs=(P(), specs)))
  return f, state, specs


def run_shard_map(tx, grads, mesh, steps=1, axis="data"):
  """Applies ``tx.update`` ``steps`` times to per-device gradients.

  ``grads``: pytree whose leaves have a leading axis of size ``p`` (one
  gradient per device), or a list of such pytrees, one per step.
  Returns (updates of the last step (replicated), pmean of the last step's
  grads, final state (global view), specs).
  """
  per_step = grads if isinstance(grads, list) else [grads] * steps
  params = jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), per_step[0])
  state, specs = jaxcomp.init_sharded(tx, params, mesh, axis)

  def body(g, s):
    g = jax.tree.map(lambda x: x[0], g)
    u, s = tx.update(g, jaxcomp.to_local(s, specs))
    return u, jax.tree.map(lambda x: lax.pmean(x, axis), g), jaxcomp.to_global(s, specs)

  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(axis), specs),
                            out_specs=(P(), P(), specs)))
  for g in per_step:
    u, ref, state = f(stacked(g, mesh, axis), state)
  return u, ref, state, specs


def run_pmap(tx, grads, axis="data"):
  params = jax.tree.map(lambda g: jnp.zeros_like(g), grads)
  state = jax.pmap(tx.init, axis_name=axis)(params)

  def body(g, s):
    u, s = tx.update(g, s)
    return u, jax.tree.map(lambda x: lax.pmean(x, axis), g), s

  return jax.pmap(body, axis_name=axis)(grads, state)


def feedback_round(fb, x, state, exchange):
  """One step of the feedback scheme ``fb`` around a fake ``exchange(v) ->
  (mean, local)`` (parts in, parts out), as the transform runs it."""
  v, ctx = fb.prepare(x, state)
  mean, local = exchange(v)
  return fb.finish(ctx, mean, local)


def examples(fraction: float, least: int = 4) -> int:
  """``max_examples`` for a costly property: ``fraction`` of the active
  Hypothesis profile's (``tests/conftest.py``), at least ``least``."""
  from hypothesis import settings  # pylint: disable=g-import-not-at-top
  return max(least, round(settings().max_examples * fraction))
