"""Profiles the user's own model on the device at hand: :func:`profile`.

The forward pass and the whole backward pass are compiled and timed with
JAX's own timing (no profiler). The backward time is then split across the
gradient tensors in backward order: the parameter leaves are put in the
order the forward pass first uses them (read from the jaxpr) and cut into
at most ``max_groups`` consecutive groups, and for each group ``g`` the
gradient with respect to groups ``g..G-1`` only is compiled. XLA prunes the
backward pass below the earliest requested parameter, so the difference
between consecutive suffixes is one group's share of the backward pass:
by XLA's cost analysis of each suffix (``split="cost"``, the FLOPs of
``jax.jit(...).lower(...).compile().cost_analysis()``; no timing noise) or
by timing each suffix (``split="measure"``). A group's share is split over
its tensors by size.
"""

from __future__ import annotations

import datetime
from typing import Any
from collections.abc import Callable

import jax
import jax.extend.core
import jax.numpy as jnp

from jaxcomp import train
from jaxcomp.perfmodel import model_profile as _model_profile
from jaxcomp.perfmodel.codec import time_fn

__all__ = ["profile", "forward_order"]


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


def profile(model_or_loss: Any, *args, params=None, loss: Callable | None = None,
            name: str | None = None, split: str = "cost", max_groups: int = 16,
            repeats: int = 5, update_fn: Callable | None = None
            ) -> _model_profile.ModelProfile:
  """Measures a :class:`ModelProfile` of the user's model on the default device.

  Two forms::

    profile(loss_fn, params, *batch)   # loss_fn(params, *batch) -> scalar
    profile(module, *batch)            # a flax.nnx.Module (linen: params=)

  ``params`` may be a :class:`jaxcomp.TrainState` (its
  :meth:`~jaxcomp.TrainState.model_params` are profiled), so a step built
  by :func:`jaxcomp.make_train_step` is profiled as
  ``profile(loss_fn, state, batch)`` with the loss it was built from.

  Args:
    model_or_loss: the loss function, or a Flax module.
    *args: ``params, *batch`` for a loss; ``*batch`` (``(x,)`` or ``(x, y)``)
      for a module: one worker's batch.
    params: a linen module's ``"params"`` collection.
    loss: for a module, ``loss(outputs, *targets) -> scalar``; default:
      softmax cross-entropy for integer targets, mean squared error for
      float targets, mean of the outputs' squares without targets.
    name: label (default: the module's class name, or ``"model"``).
    split: how the backward time is split across the tensors: ``"cost"``
      (XLA's FLOPs of each suffix gradient) or ``"measure"`` (each suffix
      gradient timed).
    max_groups: most suffix gradients to compile (each costs one
      compilation); tensors are grouped consecutively in forward order.
    repeats: timed runs per measurement (the median is used).
    update_fn: optional ``(params, grads) -> params`` whose time is the update.

  Returns:
    A profile with one entry per parameter leaf in forward order (float32
    elements; seconds). ``meta`` records the device, the JAX version, the
    batch's shapes and dtypes, the date, the leaf paths and how each
    number was obtained (``"forward_time"``, ``"backward_times"``,
    ``"update_time"``, ``"timing"``).

  Raises:
    ValueError: ``max_groups < 1``, an unknown ``split``, no parameters,
      or a linen module without ``params``.
    TypeError: a first argument that is neither callable nor a Flax module.
  """
  loss_fn, params_, batch, name = _loss_of(model_or_loss, args, params, loss, name)
  if max_groups < 1:
    raise ValueError(f"max_groups must be >= 1, got {max_groups=}")
  if split not in ("cost", "measure"):
    raise ValueError(f"split must be 'cost' or 'measure', got {split!r}")
  if isinstance(params_, train.TrainState):
    params_ = params_.model_params()
  leaves, treedef = jax.tree.flatten(params_)
  if not leaves:
    raise ValueError("params has no leaves")
  paths = [jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path(params_)[0]]
  order = forward_order(lambda ls, *b: loss_fn(jax.tree.unflatten(treedef, ls), *b),
                        leaves, *batch)
  order = [i for i in order if i < len(leaves)]
  g_count = min(max_groups, len(leaves))
  bounds = [round(g * len(leaves) / g_count) for g in range(g_count + 1)]
  groups = [order[bounds[g]:bounds[g + 1]] for g in range(g_count)]
  suffix = _Suffixes(loss_fn, leaves, treedef, groups, batch)
  fwd_jit = jax.jit(loss_fn)
  fwd = time_fn(fwd_jit, params_, *batch, repeats=repeats)
  total = max(suffix.time(0, repeats) - fwd, 0.0)
  if split == "cost":
    ends = [suffix.flops(g) for g in range(g_count)]
    ends.append(_flops(fwd_jit, params_, *batch))
    how = f"split by XLA cost analysis (FLOPs) of {g_count} suffix gradients"
  else:
    ends = [suffix.time(g, repeats) for g in range(g_count)] + [fwd]
    how = f"split by the timed differences of {g_count} suffix gradients"
  raw = [max(ends[g] - ends[g + 1], 0.0) for g in range(g_count)]
  if sum(raw) <= 0:
    # The differences drowned in timing noise (tiny models, busy machines):
    # split the measured total by the groups' sizes rather than report 0.
    raw = [float(sum(leaves[i].size for i in grp)) for grp in groups]
    how += " (all differences <= 0 in timing noise: split by element count)"
  scale = total / sum(raw) if sum(raw) > 0 else 0.0
  bwd = [0.0] * len(leaves)
  for g, grp in enumerate(groups):
    size = sum(leaves[i].size for i in grp) or 1
    for i in grp:
      bwd[i] = raw[g] * scale * leaves[i].size / size
  update = 0.0
  if update_fn is not None:
    grads = jax.tree.map(jnp.ones_like, params_)
    update = time_fn(jax.jit(update_fn), params_, grads, repeats=repeats)
  timed = f"measured: jax.jit wall time on {_device()}, median of {repeats}"
  return _model_profile.ModelProfile(
      name=name,
      layer_sizes=tuple(leaves[i].size for i in order),
      backward_times=tuple(bwd[i] for i in order),
      forward_time=fwd,
      update_time=update,
      meta={"device": _device(), "jax": jax.__version__,
            "batch": [f"{jnp.dtype(x.dtype).name}{list(x.shape)}"
                      for x in jax.tree.leaves(batch)],
            "date": datetime.date.today().isoformat(),
            "paths": [paths[i] for i in order],
            "sizes": "the parameters' leaves",
            "forward_time": f"{timed} (loss only)",
            "backward_times": (f"{timed} (value_and_grad minus the forward pass), {how}"),
            "update_time": (f"{timed} (update_fn)" if update_fn is not None
                            else "assumed 0 (no update_fn)"),
            "timing": f"{timed}; backward {how}",
            "backward_total": total})


def _device() -> str:
  dev = jax.devices()[0]
  return f"{dev.platform}:{dev.device_kind}"


def _flops(jitted, *args) -> float:
  """XLA's FLOP count of ``jitted(*args)`` (``compile().cost_analysis()``)."""
  cost = jitted.lower(*args).compile().cost_analysis()
  if isinstance(cost, (list, tuple)):  # older JAX: one dict per module
    cost = cost[0] if cost else {}
  flops = (cost or {}).get("flops")
  if flops is None:
    raise ValueError("this backend's cost analysis has no FLOP count: pass "
                     "split='measure'")
  return float(flops)


class _Suffixes:
  """The gradient with respect to groups ``g..G-1`` of the parameter leaves."""

  def __init__(self, loss_fn, leaves, treedef, groups, batch):
    self.loss_fn, self.leaves, self.treedef = loss_fn, leaves, treedef
    self.groups, self.batch = groups, batch

  def _jitted(self, g):
    want = sorted(i for grp in self.groups[g:] for i in grp)
    wanted_set = set(want)
    loss_fn, treedef = self.loss_fn, self.treedef

    def f(wanted, rest, *b):
      ls = list(rest)
      for i, w in zip(want, wanted):
        ls[i] = w
      return loss_fn(jax.tree.unflatten(treedef, ls), *b)

    wanted = [self.leaves[i] for i in want]
    rest = [None if i in wanted_set else x for i, x in enumerate(self.leaves)]
    return jax.jit(jax.value_and_grad(f)), (wanted, rest, *self.batch)

  def time(self, g: int, repeats: int) -> float:
    fn, args = self._jitted(g)
    return time_fn(fn, *args, repeats=repeats)

  def flops(self, g: int) -> float:
    fn, args = self._jitted(g)
    return _flops(fn, *args)


def _loss_of(model_or_loss, args, params, loss, name):
  """``(loss_fn, params, batch, name)`` of :func:`profile`'s two forms."""
  try:
    from flax import linen, nnx
    is_flax = isinstance(model_or_loss, (nnx.Module, linen.Module))
  except ImportError:  # flax is optional
    is_flax = False
  if is_flax:
    return _flax_loss(model_or_loss, args, params, loss, name)
  if not callable(model_or_loss):
    raise TypeError(f"profile takes a loss function or a Flax module, got "
                    f"{type(model_or_loss).__name__}")
  if not args:
    raise ValueError("profile(loss_fn, params, *batch) needs params")
  return model_or_loss, args[0], tuple(args[1:]), name or "model"


def _flax_loss(model, batch, params, loss, name):
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

    def nnx_loss(p, x, *targets):
      return loss(nnx.merge(graphdef, p, rest)(x), *targets)

    return nnx_loss, state, tuple(batch), name
  assert isinstance(model, linen.Module)
  if params is None:
    raise ValueError("a linen model needs params= (the 'params' collection)")

  def linen_loss(p, x, *targets):
    return loss(model.apply({"params": p}, x), *targets)

  return linen_loss, params, tuple(batch), name
