"""Profiles a real model: gradient sizes and measured forward/backward times.

Per-tensor backward times are measured with JAX's own timing, no profiler:
the parameter leaves are put in the order the forward pass first uses them
(read from the jaxpr), split into at most ``max_groups`` consecutive groups, and
for each group ``g`` the gradient with respect to groups ``g..G-1`` only is
jitted and timed. XLA prunes the backward pass below the earliest requested
parameter, so the difference between consecutive suffix timings is the
backward time of one group; it is split over the group's tensors by size.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import jax
import jax.extend.core
import jax.numpy as jnp

from jaxcomp.perfmodel import model_profile as _model_profile
from jaxcomp.perfmodel.codec import time_fn

__all__ = ["profile_model", "profile_flax", "forward_order"]


def _sub_jaxprs(eqn):
  # JAX's public helper: the jaxprs an equation holds (a jit's body, a
  # custom_vjp's function), whatever its primitive names them (JAX 0.11
  # merged Jaxpr and ClosedJaxpr; the helper hides which is which).
  return list(jax.extend.core.jaxprs_in_params(eqn.params))


def forward_order(fn: Callable, *args) -> list[int]:
  """Flat indices of ``args``' leaves, sorted by first use when tracing ``fn``."""
  closed = jax.make_jaxpr(fn)(*args)
  first: dict[Any, int] = {}
  counter = [0]

  def visit(jaxpr, names):
    # names: var in this jaxpr -> flat leaf index
    for eqn in jaxpr.eqns:
      counter[0] += 1
      subs = list(_sub_jaxprs(eqn))
      used = [names[v] for v in eqn.invars
              if isinstance(v, jax.extend.core.Var) and v in names]
      if len(subs) == 1 and len(subs[0].invars) == len(eqn.invars):
        inner = {iv: names[ov] for ov, iv in zip(eqn.invars, subs[0].invars)
                 if isinstance(ov, jax.extend.core.Var) and ov in names}
        visit(subs[0], inner)
      for leaf in used:
        first.setdefault(leaf, counter[0])

  visit(closed.jaxpr, {v: i for i, v in enumerate(closed.jaxpr.invars)})
  n = len(closed.jaxpr.invars)
  return sorted(range(n), key=lambda i: (first.get(i, counter[0] + 1), i))


def profile_model(loss_fn: Callable, params, *batch, name: str = "model",
                  max_groups: int = 16, repeats: int = 5,
                  update_fn: Callable | None = None) -> _model_profile.ModelProfile:
  """Measures a :class:`ModelProfile` of ``loss_fn(params, *batch)`` on the default device.

  Args:
    loss_fn: scalar loss of ``params`` (a pytree of float arrays) and the batch.
    params: the parameters.
    *batch: the rest of ``loss_fn``'s arguments (one worker's batch).
    name: label of the profile.
    max_groups: most suffix gradients to compile and time (each costs one
      compilation); tensors are grouped consecutively in forward order.
    repeats: timed runs per measurement (median).
    update_fn: optional ``(params, grads) -> params`` whose time is the update.

  Returns:
    A profile with one entry per parameter leaf in forward order; ``meta``
    records the device, the leaf paths and the measured totals.
  """
  if max_groups < 1:
    raise ValueError(f"max_groups must be >= 1, got {max_groups=}")
  leaves, treedef = jax.tree.flatten(params)
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params)[0]]
  if not leaves:
    raise ValueError("params has no leaves")
  nleaves = len(leaves)
  order = forward_order(lambda ls, *b: loss_fn(jax.tree.unflatten(treedef, ls), *b),
                        leaves, *batch)
  order = [i for i in order if i < nleaves]
  G = min(max_groups, nleaves)
  bounds = [round(g * nleaves / G) for g in range(G + 1)]
  groups = [order[bounds[g]:bounds[g + 1]] for g in range(G)]

  def suffix_grad(g):
    want = sorted(i for grp in groups[g:] for i in grp)

    def f(wanted, rest, *b):
      ls = list(rest)
      for i, w in zip(want, wanted):
        ls[i] = w
      return loss_fn(jax.tree.unflatten(treedef, ls), *b)

    gf = jax.jit(jax.value_and_grad(f))
    wanted = [leaves[i] for i in want]
    rest = [None if i in set(want) else leaves[i] for i in range(nleaves)]
    return time_fn(gf, wanted, rest, *batch, repeats=repeats)

  fwd = time_fn(jax.jit(loss_fn), params, *batch, repeats=repeats)
  suffix = [suffix_grad(g) for g in range(G)] + [fwd]
  total_bwd = max(suffix[0] - fwd, 0.0)
  raw = [max(suffix[g] - suffix[g + 1], 0.0) for g in range(G)]
  scale = total_bwd / sum(raw) if sum(raw) > 0 else 0.0
  bwd = [0.0] * nleaves
  for g, grp in enumerate(groups):
    size = sum(leaves[i].size for i in grp) or 1
    for i in grp:
      bwd[i] = raw[g] * scale * leaves[i].size / size
  update = 0.0
  if update_fn is not None:
    grads = jax.tree.map(jnp.ones_like, params)
    update = time_fn(jax.jit(update_fn), params, grads, repeats=repeats)
  dev = jax.devices()[0]
  return _model_profile.ModelProfile(
      name=name,
      layer_sizes=tuple(leaves[i].size for i in order),
      backward_times=tuple(bwd[i] for i in order),
      forward_time=fwd,
      update_time=update,
      meta={"device": f"{dev.platform}:{dev.device_kind}",
            "paths": [paths[i] for i in order],
            "timing": f"jax.jit wall time, median of {repeats}, {G} suffix-gradient groups",
            "backward_total": total_bwd})


def profile_flax(model, *batch, params=None, loss: Callable | None = None,
                 name: str | None = None, **kwargs) -> _model_profile.ModelProfile:
  """:func:`profile_model` for a Flax model.

  Args:
    model: a ``flax.nnx.Module`` (parameters taken from it) or a
      ``flax.linen.Module`` (pass ``params``, the ``"params"`` collection).
    *batch: ``(x,)`` or ``(x, y)``.
    params: linen parameters.
    loss: ``loss(outputs, *targets) -> scalar``; default: softmax cross-entropy
      for integer targets, mean squared error for float targets, mean of the
      outputs' squares without targets.
    name: label (default: the model's class name).
    **kwargs: passed to :func:`profile_model`.
  """
  from flax import linen, nnx
  import optax

  def default_loss(out, *targets):
    if not targets:
      return jnp.mean(out.astype(jnp.float32) ** 2)
    (y,) = targets
    if jnp.issubdtype(y.dtype, jnp.integer):
      return optax.softmax_cross_entropy_with_integer_labels(out, y).mean()
    return jnp.mean((out - y) ** 2)

  loss = loss or default_loss
  name = name or type(model).__name__
  if isinstance(model, nnx.Module):
    graphdef, state, rest = nnx.split(model, nnx.Param, ...)

    def loss_fn(p, x, *targets):
      return loss(nnx.merge(graphdef, p, rest)(x), *targets)

    return profile_model(loss_fn, state, *batch, name=name, **kwargs)
  if isinstance(model, linen.Module):
    if params is None:
      raise ValueError("a linen model needs params= (the 'params' collection)")

    def loss_fn(p, x, *targets):
      return loss(model.apply({"params": p}, x), *targets)

    return profile_model(loss_fn, params, *batch, name=name, **kwargs)
  raise TypeError(f"model must be a flax.nnx.Module or flax.linen.Module, got {type(model).__name__}")
