"""Shared test helpers: run a transform's update under ``jax.shard_map`` (or
``jax.pmap``) on stacked per-device gradients."""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

import jaxcomp

# JAX 0.11's XLA crashes (a segmentation fault in the SPMD partitioner)
# compiling a jax.shard_map that takes a zero-size sharded argument and runs
# any collective, with or without jaxcomp (tests/test_jax_bugs.py holds the
# reproducer); JAX 0.10 and 0.12 compile it. Tests that hand shard_map
# zero-size gradients leave them out there.
ZERO_SIZE_ARGS_CRASH = jax.__version_info__[:2] == (0, 11)


def stacked(tree, mesh, axis="data"):
  """Puts a pytree whose leaves have a leading device axis onto the mesh."""
  return jax.device_put(tree, NamedSharding(mesh, P(axis)))


def zeros_params(grads):
  """Zero parameters for per-device ``grads``: each leaf without its
  leading device axis."""
  return jax.tree.map(lambda g: jnp.zeros(g.shape[1:], g.dtype), grads)


def sharded_update(tx, params, mesh, axis="data", *, ref=False,
                   params_spec=None, updates_spec=P(), init=None):
  """``tx.update`` under ``jax.shard_map``, for per-device gradients.

  Returns ``(f, state, specs)``: ``f(grads, state) -> (updates, state)`` is
  jitted, takes gradients whose leaves have a leading device axis (sharded
  over ``axis``, a mesh axis or a tuple of them, e.g. by :func:`stacked`)
  and returns the updates (placed by ``updates_spec``: replicated unless
  told, e.g. ``P(axis)`` for ``output="shard"``) and the state's global
  view; ``state`` is ``tx``'s initial state for ``params``
  (``jaxcomp.placement.init_sharded``), or ``init``, a ``(state, specs)`` made
  elsewhere (e.g. ``(s.opt_state, s.specs)`` of ``jaxcomp.init(...,
  layout=jaxcomp.FSDP())``; ``params`` is then unused).

  ``ref=True``: ``f`` also returns the pmean of the gradients (replicated),
  ``(updates, mean, state)``. ``params_spec``: ``f(grads, state, params)``
  hands ``params`` (placed by ``params_spec``) to ``tx.update``.
  """
  state, specs = init or jaxcomp.placement.init_sharded(tx, params, mesh, axis)

  def body(g, s, *p):
    g = jax.tree.map(lambda x: x[0], g)
    u, s = tx.update(g, jaxcomp.placement.to_local(s, specs), *p)
    mean = (jax.tree.map(lambda x: lax.pmean(x, axis), g),) if ref else ()
    return (u, *mean, jaxcomp.placement.to_global(s, specs))

  in_specs = (P(axis), specs) + (() if params_spec is None else (params_spec,))
  out_specs = (updates_spec,) + ((P(),) if ref else ()) + (specs,)
  f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=in_specs,
                            out_specs=out_specs))
  return f, state, specs


class Run(NamedTuple):
  """What :func:`run_steps` returns."""

  history: list  # (updates, state (global view)) after each step
  ref: Any  # the pmean of the last step's gradients (ref=True), else None
  specs: Any  # the state's specs
  step: Any  # the jitted step, sharded_update's f
  args: tuple  # what the last step ran on: (grads on the mesh[, params])

  @property
  def updates(self):
    """The last step's updates."""
    return self.history[-1][0]

  @property
  def state(self):
    """The final state (global view)."""
    return self.history[-1][1]

  def compiled(self):
    """The step compiled for the last step's arguments and the final state
    (for ``jaxcomp.collective_traffic``)."""
    grads, *params = self.args
    return self.step.lower(grads, self.state, *params).compile()


def run_steps(tx, grads, mesh, steps=1, axis="data", *, params=None, **kw):
  """Applies ``tx.update`` ``steps`` times to per-device gradients, by
  :func:`sharded_update` (``kw``: its keyword arguments).

  ``grads``: pytree whose leaves have a leading axis of size ``p`` (one
  gradient per device), or a list of such pytrees, one per step.
  ``params``: what ``tx`` is initialised on (zeros of one device's
  gradient's shapes by default) and, where ``kw`` names a ``params_spec``,
  what each update is handed. Returns a :class:`Run`.
  """
  per_step = grads if isinstance(grads, list) else [grads] * steps
  params = zeros_params(per_step[0]) if params is None else params
  f, state, specs = sharded_update(tx, params, mesh, axis, **kw)
  extra = () if kw.get("params_spec") is None else (params,)
  history, mean = [], None
  for g in per_step:
    args = (stacked(g, mesh, axis), *extra)
    u, *mean, state = f(args[0], state, *extra)
    history.append((u, state))
  return Run(history, mean[0] if mean else None, specs, f, args)


def run_shard_map(tx, grads, mesh, steps=1, axis="data"):
  """Applies ``tx.update`` ``steps`` times to per-device gradients.

  ``grads``: pytree whose leaves have a leading axis of size ``p`` (one
  gradient per device), or a list of such pytrees, one per step.
  Returns (updates of the last step (replicated), pmean of the last step's
  grads, final state (global view), specs).
  """
  run = run_steps(tx, grads, mesh, steps, axis, ref=True)
  return run.updates, run.ref, run.state, run.specs


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


def gspmd_sgd_steps(loss_fn, lr: float = 0.1):
  """``(plain, compressed)``: the plain GSPMD SGD step of ``loss_fn``
  (``plain(params, batch) -> (params, loss)``, jitted) and
  ``compressed(grad_fn)``, the same step with the gradient line of a
  :func:`jaxcomp.compressed_value_and_grad` (``step(params, comp_state,
  batch) -> (params, comp_state, loss)``, jitted)."""
  update = lambda params, grads: jax.tree.map(lambda p, g: p - lr * g, params, grads)

  @jax.jit
  def plain(params, batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, batch)
    return update(params, grads), loss

  def compressed(grad_fn):
    @jax.jit
    def step(params, comp_state, batch):
      (loss, grads), comp_state = grad_fn(params, comp_state, batch)
      return update(params, grads), comp_state, loss
    return step

  return plain, compressed
