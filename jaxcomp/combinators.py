"""Gradient accumulation and non-finite skipping around a compressed chain.

Optax's own combinators decide per device, and their branches run the
inner transform whatever they decide, so around a chain that exchanges
gradients they either send on every micro-step (``optax.MultiSteps`` runs
the inner update on every micro-step and keeps its result only on the
last) or cannot trace (``optax.apply_if_finite`` checks each device's own
gradient, so devices could disagree about whether to run the collectives).
The two here decide the same way on every device, and put the whole inner
update, its collectives included, inside the branch that runs:

* :func:`multi_steps` accumulates ``k`` micro-steps' gradients locally and
  runs the inner chain (one compressed exchange) on the ``k``-th;
* :func:`apply_if_finite` skips the whole inner update (no exchange, no
  optimizer moment or count moves) on a step where any device's gradient
  has a NaN or an Inf.

Both run inside ``jax.shard_map`` / ``jax.pmap`` over ``axis_name`` and are
placed by :func:`jaxcomp.init` (the accumulator is per device).
"""

from __future__ import annotations

import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp import _mesh
from jaxcomp import transform
from jaxcomp import wire
from jaxcomp._mesh import AxisName


def _zeros_like_typed(tree):
  """Zeros of ``tree``'s shapes, dtypes and varying axes (``tree`` is the
  ``jax.eval_shape`` of the update the other branch returns): invariant
  where that update is (an averaged one), varying where it is (a shard of
  the mean, ``compressed_mean(output="shard")``)."""
  def zeros(x):
    z = jnp.zeros(jnp.shape(x), jnp.result_type(x))
    axes = tuple(sorted(_mesh.varying_axes(x)))
    return _mesh.to_varying(z, axes) if axes else z
  return jax.tree.map(zeros, tree)


def _as_structure(state, like):
  """``state``'s arrays in the tree structure of ``like`` (the state the
  other branch returns): the same leaves, the static data (a transform's
  configuration) of the transform that runs, so that both branches of the
  ``lax.cond`` agree when a state passes from one transform to another of
  the same shapes (a warm-up stage's to the next)."""
  return jax.tree.unflatten(jax.tree.structure(like), jax.tree.leaves(state))


def _shard_group(inner_state) -> int:
  """Devices a ``compressed_mean(output="shard")`` in ``inner_state``
  reduce-scatters over (the parameters are its flat shards); 1 without one."""
  for c in transform.transform_configs(inner_state).values():
    if c.get("output") == "shard":
      return wire.devices(_mesh.axis_sizes(c["axis_name"]))
  return 1


def _as_acc(g, acc):
  """The gradient leaf ``g`` in the accumulator's layout, float32: its own
  shape, or (FSDP) flat, zero-padded to ``p * c`` and shaped ``(p, c)``."""
  g = g.astype(jnp.float32)
  if jnp.shape(g) == jnp.shape(acc):
    return g
  g = g.reshape(-1)
  return jnp.pad(g, (0, acc.size - g.size)).reshape(acc.shape)


def _from_acc(acc, g):
  """The accumulator leaf back in the gradient leaf ``g``'s shape and dtype."""
  if jnp.shape(acc) != jnp.shape(g):
    acc = acc.reshape(-1)[:jnp.size(g)].reshape(jnp.shape(g))
  return acc.astype(jnp.result_type(g))


def _check_accumulator(acc, updates) -> None:
  """Raises ValueError, naming the leaf, where a gradient leaf fits neither
  the accumulator's shape nor (FSDP) its ``(p, c)`` layout: ``p`` chunks
  of ``c = ceil(n / p)`` elements."""
  def check(path, a, g):
    if jnp.shape(a) == jnp.shape(g):
      return
    if jnp.ndim(a) == 2 and a.shape[1] == -(-jnp.size(g) // a.shape[0]):
      return
    raise ValueError(
        f"multi_steps: the gradient leaf {jax.tree_util.keystr(path)} has shape "
        f"{jnp.shape(g)} but the accumulator was initialised for "
        f"{jnp.shape(a)}; initialise with the parameters the gradients are "
        "taken of (under FSDP, with jaxcomp.init(..., layout=jaxcomp.FSDP()))")
  jax.tree_util.tree_map_with_path(check, acc, updates)


class MultiStepsState(NamedTuple):
  """State of :func:`multi_steps`."""

  mini_step: jax.Array  # shape=(), int32, micro-steps since the last exchange
  gradient_step: jax.Array  # shape=(), int32, optimizer steps taken
  acc_grads: Any  # like the gradients, float32, per device: this round's sum
  inner_state: Any  # the inner transform's state


def multi_steps(tx: optax.GradientTransformation, every_k: int,
                axis_name: AxisName = "data") -> optax.GradientTransformation:
  """Gradient accumulation that exchanges once per ``every_k`` micro-steps.

  Each device sums its own gradients locally (float32, no collective) for
  ``every_k`` micro-steps; on the ``every_k``-th, ``tx`` (e.g.
  ``optax.chain(jaxcomp.compressed_mean(...), optax.adam(...))``) runs once
  on the local mean, inside a ``lax.cond`` branch: its compressed
  collectives run on that micro-step only, so each micro-step sends
  ``1 / every_k`` of the bytes of an unaccumulated step
  (:func:`jaxcomp.get_stats` reports those exchanges with ``every``
  multiplied by ``every_k``: calls of the step per exchange). The other
  micro-steps return zero updates and leave ``tx``'s state untouched, as
  ``optax.MultiSteps`` does.

  Use it in place of ``optax.MultiSteps(tx, every_k)`` (which runs the
  inner update, and its collectives, on every micro-step and keeps the
  result of the last), with the same step function: the ``emit`` step is
  every ``every_k``-th call.

  Around an FSDP chain (``compressed_mean(..., output="shard")``,
  :mod:`jaxcomp.fsdp`) the parameters are flat shards while the gradients
  are whole: the accumulator then holds each device's whole gradient, flat
  and zero-padded to ``(p, c)`` (``c`` the shard size): one whole-gradient
  float32 buffer per device, as PyTorch FSDP's ``no_sync`` keeps.

  Args:
    tx: the inner transformation, compressed mean included.
    every_k: micro-steps per optimizer step, a Python integer >= 1.
    axis_name: the data-parallel axis (or tuple of axes) ``tx`` averages
      over; the accumulator varies over it.

  Returns:
    A ``GradientTransformation`` whose state is :class:`MultiStepsState`.

  Raises:
    ValueError: ``every_k`` is not an integer >= 1, or a bad ``axis_name``;
      at trace time, a gradient leaf whose shape the accumulator (made from
      the parameters ``init`` got) cannot hold.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.multi_steps(optax.chain(
    ...     jaxcomp.compressed_mean("topk", "data"), optax.sgd(0.1)), 4)
    >>> state, specs = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros(8)}, mesh,
    ...                                     "data")
    >>> specs.acc_grads  # the accumulator is per device
    {'w': P('data',)}

  References:
    Goyal et al., Accurate, Large Minibatch SGD: Training ImageNet in 1 Hour
    <https://arxiv.org/abs/1706.02677>, 2017 (large batches); Lin et al.,
    Deep Gradient Compression <https://arxiv.org/abs/1712.01887>, 2018
    (local accumulation before a sparse exchange).
  """
  if (isinstance(every_k, bool) or not isinstance(every_k, numbers.Integral)
      or every_k < 1):
    raise ValueError(f"every_k must be an integer >= 1, got {every_k=!r}")
  _mesh.check_axis_name(axis_name)

  def init_fn(params):
    # Its exchanges run once per every_k calls (get_stats says so).
    inner_state = transform.in_micro_steps(tx.init(params), every_k)
    # FSDP: the parameters are flat shards of c elements but the gradient
    # is the whole parameters' (jaxcomp.fsdp); the accumulator holds each
    # leaf flat, zero-padded to the shards' whole size, as (p, c).
    p = _shard_group(inner_state) if _mesh.bound_axes() else 1
    acc = jax.tree.map(
        lambda x: jnp.zeros((p, jnp.size(x)) if p > 1 else jnp.shape(x),
                            jnp.float32), params)
    if _mesh.bound_axes():
      acc = _mesh.to_varying(acc, axis_name)
    return MultiStepsState(mini_step=jnp.zeros((), jnp.int32),
                           gradient_step=jnp.zeros((), jnp.int32),
                           acc_grads=acc, inner_state=inner_state)

  def update_fn(updates, state, params=None):
    _check_accumulator(state.acc_grads, updates)
    acc = jax.tree.map(lambda a, g: a + _as_acc(g, a), state.acc_grads,
                       updates)
    emit = state.mini_step == every_k - 1

    def run(inner_state):
      mean = jax.tree.map(lambda a, g: _from_acc(a / every_k, g), acc,
                          updates)
      return tx.update(mean, inner_state, params)

    def wait(inner_state):
      out, state = jax.eval_shape(run, inner_state)
      return _zeros_like_typed(out), _as_structure(inner_state, state)

    new_updates, inner_state = lax.cond(emit, run, wait, state.inner_state)
    inner_state = transform.in_micro_steps(inner_state, every_k)
    return new_updates, MultiStepsState(
        mini_step=jnp.where(emit, 0, state.mini_step + 1),
        gradient_step=state.gradient_step + emit.astype(jnp.int32),
        acc_grads=jax.tree.map(lambda a: jnp.where(emit, jnp.zeros_like(a), a),
                               acc),
        inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)


class ApplyIfFiniteState(NamedTuple):
  """State of :func:`apply_if_finite` (as ``optax.ApplyIfFiniteState``)."""

  notfinite_count: jax.Array  # shape=(), int32, consecutive skipped steps
  last_finite: jax.Array  # shape=(), bool, whether the last step was applied
  total_notfinite: jax.Array  # shape=(), int32, steps skipped in all
  inner_state: Any  # the inner transform's state


def apply_if_finite(tx: optax.GradientTransformation, axis_name: AxisName,
                    max_consecutive_errors: int | None = None
                    ) -> optax.GradientTransformation:
  """Skips the whole update when any device's gradient is not finite.

  One scalar all-reduce tells every device whether some device's gradient
  has a NaN or an Inf. If so, the update is zero and ``tx`` does not run at
  all: no collective, and ``tx``'s state (error-feedback residuals,
  optimizer moments and counts) is exactly as before. The parameters then
  do not move (``optax.apply_updates`` adds zeros). After
  ``max_consecutive_errors`` skipped steps in a row the next one runs
  anyway, as in ``optax.apply_if_finite`` (``compressed_mean``'s own
  ``nonfinite`` policy then decides).

  ``optax.apply_if_finite`` around a compressed chain cannot work: it checks
  each device's own gradient, so the devices could disagree about running
  the collectives (with ``check_vma`` on it does not trace).

  Args:
    tx: the inner transformation, e.g. ``optax.chain(
      jaxcomp.compressed_mean(...), optax.adam(...))``.
    axis_name: the data-parallel axis (or tuple of axes).
    max_consecutive_errors: skipped steps in a row after which a step runs
      anyway; None: never.

  Returns:
    A ``GradientTransformation`` whose state is :class:`ApplyIfFiniteState`.

  Raises:
    ValueError: a bad ``axis_name`` or a negative ``max_consecutive_errors``.

  Example:
    >>> import optax, jaxcomp
    >>> tx = jaxcomp.apply_if_finite(optax.chain(
    ...     jaxcomp.compressed_mean("topk", "data", ratio=0.01),
    ...     optax.adam(1e-3)), "data")
  """
  _mesh.check_axis_name(axis_name)
  if max_consecutive_errors is not None and (
      isinstance(max_consecutive_errors, bool)
      or not isinstance(max_consecutive_errors, numbers.Integral)
      or max_consecutive_errors < 0):
    raise ValueError(f"max_consecutive_errors must be an integer >= 0 or "
                     f"None, got {max_consecutive_errors=!r}")

  def init_fn(params):
    return ApplyIfFiniteState(
        notfinite_count=jnp.zeros((), jnp.int32),
        last_finite=jnp.ones((), jnp.bool_),
        total_notfinite=jnp.zeros((), jnp.int32),
        inner_state=tx.init(params))

  def update_fn(updates, state, params=None):
    _mesh.check_bound(axis_name, "jaxcomp.apply_if_finite")
    local_bad = jnp.zeros((), jnp.int32)
    for g in jax.tree.leaves(updates):
      local_bad = local_bad | (~jnp.all(jnp.isfinite(g))).astype(jnp.int32)
    finite = lax.psum(local_bad, axis_name) == 0
    count = jnp.where(finite, 0, state.notfinite_count + 1)
    run_anyway = (False if max_consecutive_errors is None
                  else count > max_consecutive_errors)

    def run(inner_state):
      return tx.update(updates, inner_state, params)

    def skip(inner_state):
      out, state = jax.eval_shape(run, inner_state)
      # Every inner leaf stays bit for bit as it was, its statistics too:
      # this skip is counted in total_notfinite, not in get_stats'
      # skipped_steps.
      return _zeros_like_typed(out), _as_structure(inner_state, state)

    new_updates, inner_state = lax.cond(finite | run_anyway, run, skip,
                                        state.inner_state)
    return new_updates, ApplyIfFiniteState(
        notfinite_count=count, last_finite=finite,
        total_notfinite=state.total_notfinite + (~finite).astype(jnp.int32),
        inner_state=inner_state)

  return optax.GradientTransformation(init_fn, update_fn)

