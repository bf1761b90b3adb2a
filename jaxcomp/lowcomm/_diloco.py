"""DiLoCo with compressed pseudo-gradients: the transform and its state.

DiLoCo (Douillard et al. 2023) lets every device train on its own for
``H`` steps with an *inner* optimizer, with no communication at all; every
``H``-th step the devices average their *pseudo-gradients* (how far each
moved from the last synchronized parameters) and an *outer* optimizer
(Nesterov SGD, lr 0.7, momentum 0.9 in the paper) moves the synchronized
parameters by that average. Here the average is a
:func:`jaxcomp.compressed_mean`, so the pseudo-gradient travels compressed,
with any compressor, collective and error feedback (PRIME / INTELLECT-1
send int8 pseudo-gradients; SparseLoCo top-k with error feedback).

Between syncs the parameters differ per device, so a DiLoCo run carries them
per device (a leading device axis, like per-device state): use
:func:`jaxcomp.init` and :func:`jaxcomp.make_train_step` with
``layout=jaxcomp.Islands()``, or place them yourself with ``P(axis_name)``. After a sync every device holds the same parameters,
:func:`synced_params` (the outer optimizer's parameters) at any time.

References:
  Douillard et al., DiLoCo: Distributed Low-Communication Training of
  Language Models <https://arxiv.org/abs/2311.08105>, 2023; Jaghouar et al.,
  INTELLECT-1 Technical Report <https://arxiv.org/abs/2412.01152>, 2024
  (int8 pseudo-gradients); Sarfi et al., SparseLoCo
  <https://arxiv.org/abs/2508.15706>, 2025 (top-k pseudo-gradients with
  error feedback).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
import optax

from jaxcomp import _mesh
from jaxcomp import distributed
from jaxcomp import optimizers
from jaxcomp import transform
from jaxcomp import wire
from jaxcomp._mesh import AxisName


class DiLoCoState(NamedTuple):
  """State of :func:`diloco`."""

  step: jax.Array  # shape=(), int32, inner steps taken
  inner_state: Any  # the inner optimizer's, per device
  anchor: Any  # like the parameters: the synchronized parameters (invariant)
  outer_state: tuple  # per fragment: the outer optimizer's (invariant)
  exchange_state: tuple  # per fragment: the compressed mean's (error
  #                        feedback per device)
  synced: Any  # like the parameters, bool scalars: the leaf synced last step
  pending: tuple = ()  # overlap_steps > 0: per fragment, the averaged
  #                      pseudo-gradient received at its last sync and not
  #                      yet applied (invariant); () otherwise


def diloco(inner: optax.GradientTransformation,
           outer: optax.GradientTransformation | None = None, *,
           sync_every: int, compressor: str = "identity",
           axis_name: AxisName = "data", fragments: int = 1,
           overlap_steps: int = 0, merge: float = 0.5,
           **compressed_mean_kwargs) -> optax.GradientTransformation:
  """DiLoCo: ``sync_every`` local steps of ``inner``, then an ``outer``
  step on the compressed mean of the pseudo-gradients.

  Per device, inside ``jax.shard_map`` over ``axis_name``, with this
  device's own gradient and its own (local) parameters:

  1. ``inner`` updates the local parameters (no communication);
  2. on every ``sync_every``-th step, inside a ``lax.cond`` branch (its
     collectives run on that step only): the pseudo-gradient ``anchor -
     local`` is averaged over the devices by ``compressed_mean(compressor,
     axis_name, **compressed_mean_kwargs)``, ``outer`` updates ``anchor``
     with it, and the returned update takes every device's parameters to
     the new ``anchor`` (``params + (anchor - params)``: equal to it up to
     one float rounding; :func:`jaxcomp.make_train_step` sets them to it exactly).

  With ``sync_every=1``, ``outer=optax.sgd(1.0)`` and an uncompressed mean,
  this is data-parallel training with ``inner`` applied to the mean of the
  per-device updates (for plain SGD: data-parallel SGD; tested).

  Bytes: one exchange per ``sync_every`` steps; :func:`jaxcomp.get_stats`
  reports it with ``every=sync_every`` and its bytes per sync (a step
  averages ``bytes_sent / sync_every``), apart from any exchange of every
  step in ``inner`` (islands: the mean inside each island);
  :func:`jaxcomp.lowcomm.traffic` counts the run's total and per-step average from the
  state's counters.

  Args:
    inner: the optimizer every device runs on its own gradients (the paper:
      AdamW).
    outer: the optimizer of the synchronized parameters, fed the averaged
      pseudo-gradient; default ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)``, the paper's.
    sync_every: ``H``, inner steps per synchronization, an integer >= 1.
    compressor: the pseudo-gradient's compressor (a name or instance, as
      :func:`jaxcomp.compressed_mean` takes).
    axis_name: the data-parallel axis (or axes).
    fragments: Streaming DiLoCo (Douillard et al. 2025): the parameter
      leaves are cut into this many contiguous fragments of about equal
      size, fragment ``j`` synchronized ``j * sync_every // fragments``
      steps before the others, so that each sync sends about
      ``1 / fragments`` of the model and the peak bandwidth drops by that
      factor (each fragment has its own outer-optimizer and exchange
      state). Default 1: DiLoCo.
    overlap_steps: Streaming DiLoCo's ``tau``: a fragment's averaged
      pseudo-gradient is applied ``overlap_steps`` steps after its exchange,
      so the exchange can overlap that many steps of compute. With it the
      pseudo-gradient is taken from the step's incoming parameters (before
      that step's inner update), so nothing in the step waits for the
      collective, and when the outer update lands the local fragment
      becomes ``merge * local + (1 - merge) * anchor`` (the paper's
      mixing, ``alpha``). Default 0: the exchange and the outer step in the
      same step, every device set to the new anchor. Must be below
      ``sync_every``.
    merge: the local parameters' weight when a delayed outer update lands
      (``overlap_steps > 0`` only), in ``[0, 1]``; default 0.5, the
      paper's; 0 sets every device to the new anchor.
    **compressed_mean_kwargs: the rest of :func:`jaxcomp.compressed_mean`'s
      arguments (``error_feedback``, ``collective``, ``bucketing``,
      hyperparameters such as ``ratio`` or ``bits``, ...). ``nonfinite``
      defaults to ``"skip"`` whatever the compressor: a NaN in one
      device's pseudo-gradient skips that sync (the flag costs 4 bytes per
      fragment per sync) instead of reaching the anchor that every later
      interval starts from.

  Returns:
    A ``GradientTransformation`` whose state is :class:`DiLoCoState`;
    ``update(grads, state, params)`` needs ``params`` (the local ones).

  Raises:
    ValueError: ``sync_every`` not an integer >= 1, ``fragments`` not in
      ``[1, sync_every]`` (or, in ``init``, more than the leaves),
      ``overlap_steps`` not in ``[0, sync_every)``, ``merge`` not in
      ``[0, 1]``, or what
      :func:`jaxcomp.compressed_mean` raises for its arguments.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.diloco(optax.sgd(0.1, momentum=0.9), sync_every=50,
    ...                     compressor="int8_block", bits=4)
    >>> state = jaxcomp.init(tx, {"w": jnp.ones(8)}, mesh,
    ...                      layout=jaxcomp.Islands())
    >>> state.params["w"].shape  # one copy per device
    (8, 8)
    >>> state.specs.anchor, state.specs.inner_state[0].trace  # shared; per device
    ({'w': P()}, {'w': P('data',)})
  """
  _check_schedule(sync_every, fragments, overlap_steps, merge)
  _mesh.check_axis_name(axis_name)
  compressed_mean_kwargs.setdefault("nonfinite", "skip")
  spec = _DiLoCo(
      inner=inner,
      outer=(optax.sgd(0.7, momentum=0.9, nesterov=True) if outer is None
             else outer),
      # Its statistics say it runs once per sync_every steps.
      mean=transform.with_cadence(transform.compressed_mean(
          compressor, axis_name, **compressed_mean_kwargs), sync_every),
      axis_name=axis_name, sync_every=int(sync_every),
      # Fragment j syncs offsets[j] steps before the interval's end
      # (Streaming DiLoCo's staggered schedule).
      offsets=tuple(j * sync_every // fragments for j in range(fragments)),
      tau=int(overlap_steps), merge=merge)
  return optax.GradientTransformation(functools.partial(_init, spec),
                                      functools.partial(_update, spec))


def _check_schedule(sync_every: int, fragments: int, overlap_steps: int,
                    merge: float) -> None:
  """Construction-time checks of :func:`diloco`'s schedule arguments."""
  if (isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral)
      or sync_every < 1):
    raise ValueError(f"sync_every must be an integer >= 1, got {sync_every=!r}")
  if (isinstance(fragments, bool) or not isinstance(fragments, numbers.Integral)
      or not 1 <= fragments <= sync_every):
    raise ValueError(f"fragments must be an integer in [1, sync_every="
                     f"{sync_every}], got {fragments=!r}")
  if (isinstance(overlap_steps, bool) or not isinstance(overlap_steps, numbers.Integral)
      or not 0 <= overlap_steps < sync_every):
    raise ValueError(f"overlap_steps must be an integer in [0, sync_every="
                     f"{sync_every}), got {overlap_steps=!r}: a fragment's "
                     "outer update must land before its next exchange")
  if isinstance(merge, bool) or not isinstance(merge, numbers.Real) or not 0 <= merge <= 1:
    raise ValueError(f"merge must be a number in [0, 1], got {merge=!r}")


@dataclasses.dataclass(frozen=True)
class _DiLoCo:
  """One :func:`diloco`, its arguments checked: what ``init`` and
  ``update`` read."""

  inner: optax.GradientTransformation
  outer: optax.GradientTransformation
  mean: optax.GradientTransformation  # the pseudo-gradients' compressed mean
  axis_name: AxisName
  sync_every: int
  offsets: tuple[int, ...]  # per fragment: steps before the interval's end
  tau: int  # overlap_steps
  merge: float

  def groups(self, leaves) -> list[list[int]]:
    """Leaf indices of each fragment: contiguous in ``jax.tree.leaves``
    order, of about equal size."""
    fragments = len(self.offsets)
    if len(leaves) < fragments:
      raise ValueError(f"fragments={fragments} needs as many parameter "
                       f"leaves; the parameters have {len(leaves)}")
    prefix = [0]
    for x in leaves:
      prefix.append(prefix[-1] + int(jnp.size(x)))
    starts = [0]
    for j in range(1, fragments):
      target = j * prefix[-1] / fragments
      i = next(i for i, c in enumerate(prefix) if c >= target)
      # Non-empty fragments: after the previous start, leaving one leaf
      # for every later fragment.
      starts.append(min(max(i, starts[-1] + 1), len(leaves) - (fragments - j)))
    starts.append(len(leaves))
    return [list(range(a, b)) for a, b in zip(starts, starts[1:])]

  def syncs(self, step, j: int):
    """Whether fragment ``j`` synchronizes at ``step``."""
    return (step + 1 + self.offsets[j]) % self.sync_every == 0


def _init(spec: _DiLoCo, params) -> DiLoCoState:
  anchor = jax.tree.map(jnp.asarray, params)
  a_leaves, p_leaves = jax.tree.leaves(anchor), jax.tree.leaves(params)
  frags = spec.groups(a_leaves)
  return DiLoCoState(
      step=jnp.zeros((), jnp.int32), inner_state=spec.inner.init(params),
      anchor=anchor,
      outer_state=tuple(spec.outer.init([a_leaves[i] for i in g])
                        for g in frags),
      exchange_state=tuple(spec.mean.init([p_leaves[i] for i in g])
                           for g in frags),
      synced=jax.tree.map(lambda _: jnp.zeros((), jnp.bool_), params),
      pending=tuple([jnp.zeros(jnp.shape(a_leaves[i]),
                               jnp.result_type(a_leaves[i])) for i in g]
                    for g in frags) if spec.tau else ())


def pseudo_gradient(anchor, local):
  """DiLoCo's pseudo-gradient ``anchor - local``, leaf by leaf, in each
  local leaf's dtype (a bf16 parameter's pseudo-gradient is rounded to
  bf16, as the gradient it stands in for would be).

  Args:
    anchor: the synchronized parameters (a pytree).
    local: the parameters after the interval's inner steps, the anchor's
      structure and shapes.

  Returns:
    A pytree like ``local``: ``(a - x).astype(x.dtype)`` per leaf.
  """
  return jax.tree.map(lambda a, x: (a - x).astype(jnp.result_type(x)),
                      anchor, local)


def outer_step(outer: optax.GradientTransformation, anchor, outer_state,
               pseudo_mean):
  """DiLoCo's outer step: ``outer`` updates ``anchor`` with the averaged
  pseudo-gradient (what :func:`diloco` runs at each sync, and the elastic
  islands of :mod:`jaxcomp.elastic` after their exchange).

  Args:
    outer: the outer optimizer (DiLoCo's: Nesterov SGD, lr 0.7, momentum
      0.9).
    anchor: the synchronized parameters (a pytree).
    outer_state: ``outer``'s state for ``anchor``.
    pseudo_mean: the averaged pseudo-gradient, the anchor's structure,
      shapes and dtypes.

  Returns:
    ``(anchor, outer_state)``, both new: ``optax.apply_updates(anchor,
    u)`` with ``u, outer_state = outer.update(pseudo_mean, outer_state,
    anchor)``.
  """
  updates, outer_state = outer.update(pseudo_mean, outer_state, anchor)
  return optax.apply_updates(anchor, updates), outer_state


def _now(spec: _DiLoCo, j, g, sync, state, p_leaves, l_leaves, updates,
         anchor):
  """Fragment ``j`` without delay: on its sync step, the exchange of
  ``anchor - local``, the outer step on it, and every device's leaves set
  to the new anchor; else the inner updates. Returns the fragment's
  anchor, outer and exchange state and its leaves' updates."""
  def run(args):
    anchor_g, outer_state, exchange_state = args
    pseudo = pseudo_gradient(anchor_g, [l_leaves[i] for i in g])
    avg, exchange_state = spec.mean.update(
        pseudo, exchange_state, [l_leaves[i] for i in g])
    anchor_g, outer_state = outer_step(spec.outer, anchor_g, outer_state, avg)
    anchor_g = cast(list, anchor_g)
    # Every device lands on the fragment's new anchor.
    ups = [(a - p_leaves[i]).astype(jnp.result_type(p_leaves[i]))
           for a, i in zip(anchor_g, g)]
    return ups, (anchor_g, outer_state, exchange_state)

  def wait(args):
    return [updates[i] for i in g], args

  ups, (anchor_g, outer_state, exchange_state) = _mesh.cond(
      sync, run, wait, ([anchor[i] for i in g], state.outer_state[j],
                        state.exchange_state[j]))
  return anchor_g, outer_state, exchange_state, ups


def _delayed(spec: _DiLoCo, j, g, sync, state, p_leaves, l_leaves, updates,
             anchor):
  """Fragment ``j`` with ``overlap_steps = tau > 0``: on its sync step, the
  exchange of ``anchor - params`` (the incoming parameters) into
  ``pending``; ``tau`` steps later, the outer step on it and the merge.
  Returns the fragment's anchor, outer, exchange and pending state, its
  leaves' updates, and whether its outer update landed this step."""
  step, tau = state.step, spec.tau

  def exchange(args):
    exchange_state, pending = args
    pseudo = pseudo_gradient([anchor[i] for i in g], [p_leaves[i] for i in g])
    avg, exchange_state = spec.mean.update(pseudo, exchange_state,
                                           [p_leaves[i] for i in g])
    # A list in, a list out (optax types it as any pytree).
    avg = cast(list, avg)
    return exchange_state, [a.astype(x.dtype) for a, x in zip(avg, pending)]

  # _mesh.cond: the exchange may make pending per device (FSDP inside
  # islands: each device's shard), which init's zeros are not.
  exchange_state, pending = _mesh.cond(
      sync, exchange, lambda args: args,
      (state.exchange_state[j], list(state.pending[j])))
  # The sync tau steps ago (never before the first one).
  landed = ((step + 1 + spec.offsets[j] - tau) % spec.sync_every == 0) & (
      step >= tau)

  def land(args):
    anchor_g, outer_state = args
    anchor_g, outer_state = outer_step(spec.outer, anchor_g, outer_state,
                                       list(state.pending[j]))
    anchor_g = cast(list, anchor_g)
    m = jnp.float32(spec.merge)
    ups = [((m * l_leaves[i] + (1 - m) * a) - p_leaves[i]).astype(
        jnp.result_type(p_leaves[i])) for a, i in zip(anchor_g, g)]
    return ups, (anchor_g, outer_state)

  def keep(args):
    return [updates[i] for i in g], args

  ups, (anchor_g, outer_state) = _mesh.cond(
      landed, land, keep, ([anchor[i] for i in g], state.outer_state[j]))
  return anchor_g, outer_state, exchange_state, pending, ups, landed


def _check_local_params(spec: _DiLoCo, params) -> None:
  """Raises ValueError unless ``params`` are this device's own."""
  axis_name = spec.axis_name
  if _mesh.types_track_devices(axis_name) and any(
      not set(_mesh.axes(axis_name)) <= _mesh.varying_axes(p)
      for p in jax.tree.leaves(params)):
    raise ValueError(
        "diloco needs each device's own parameters, but these are "
        f"replicated over {axis_name!r} (identical on every device): place "
        "them with jaxcomp.init(..., layout=jaxcomp.Islands()) and step "
        "with jaxcomp.make_train_step(..., layout=jaxcomp.Islands()) "
        "(jaxcomp.flax.Optimizer for NNX)")


def _update(spec: _DiLoCo, updates, state, params=None):
  if params is None:
    raise ValueError("diloco's update needs params (this device's own "
                     "parameters): tx.update(grads, state, params)")
  _check_local_params(spec, params)
  inner_updates, inner_state = spec.inner.update(updates, state.inner_state,
                                                 params)
  local = optax.apply_updates(params, inner_updates)
  p_leaves, treedef = jax.tree.flatten(params)
  l_leaves = treedef.flatten_up_to(local)
  u_leaves = treedef.flatten_up_to(inner_updates)
  anchor = treedef.flatten_up_to(state.anchor)
  synced = [None] * len(p_leaves)
  outer_states, exchange_states, pendings = [], [], []
  for j, g in enumerate(spec.groups(p_leaves)):
    sync = spec.syncs(state.step, j)
    args = (j, g, sync, state, p_leaves, l_leaves, u_leaves, anchor)
    if spec.tau:
      (anchor_g, outer_state, exchange_state, pending, ups,
       landed) = _delayed(spec, *args)
      pendings.append(pending)
      done = landed & (spec.merge == 0)
    else:
      anchor_g, outer_state, exchange_state, ups = _now(spec, *args)
      done = sync
    for i, u, a in zip(g, ups, anchor_g):
      u_leaves[i], anchor[i], synced[i] = u, a, done
    outer_states.append(outer_state)
    exchange_states.append(exchange_state)
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)
  return unflat(u_leaves), DiLoCoState(
      step=state.step + 1, inner_state=inner_state, anchor=unflat(anchor),
      outer_state=tuple(outer_states),
      exchange_state=tuple(exchange_states), synced=unflat(synced),
      pending=tuple(pendings))


# The states that keep one copy of the parameters per device (or island)
# between synchronisations, with the synchronised copy (``anchor``) and
# which leaves synchronised last step (``synced``): DiLoCo's, and 0/1
# Adam's (its local steps).
_ISLANDS_STATES = (DiLoCoState, optimizers.ZeroOneAdamState)


def _diloco_states(opt_state, kinds=_ISLANDS_STATES) -> list:
  found = []
  jax.tree_util.tree_map(
      lambda x: found.append(x) if isinstance(x, kinds) else None,
      opt_state, is_leaf=lambda x: isinstance(x, kinds))
  return found


def _find(opt_state, kinds=_ISLANDS_STATES):
  found = _diloco_states(opt_state, kinds)
  if len(found) != 1:
    raise ValueError(f"expected one diloco state in opt_state, found {len(found)}")
  return found[0]


class LowCommTraffic(NamedTuple):
  """What a :func:`diloco` run's sync has sent so far, per device (operand
  bytes, as :class:`jaxcomp.CompressionStats` counts them; wire bytes by
  the ring algorithms beside them), the exchanges of every step inside
  ``inner`` (islands) not included: :func:`jaxcomp.get_stats` reports them
  apart. Read with :func:`traffic`."""

  steps: int  # inner steps taken
  syncs: tuple  # per fragment: its synchronizations so far
  bytes_per_interval: float  # one sync of every fragment: sync_every steps
  total_bytes: float  # sent in the run so far
  total_wire_bytes: float
  bytes_per_step: float  # total_bytes / steps: the interval's average
  dense_bytes_per_step: float  # data parallelism's dense all-reduce over
  #                               axis_name, each step (dense_bytes_of)
  reduction: float  # dense_bytes_per_step / bytes_per_step (inf before a sync)


def traffic(opt_state) -> LowCommTraffic:
  """Bytes a :func:`diloco` run has sent so far and per step on average.

  Each fragment's exchange runs only on its sync steps (inside the branch of
  the ``lax.cond``), so its :class:`jaxcomp.CompressionStats` give the bytes
  of *one* sync; the state's counters say how many there were. The total is
  ``sum over fragments of syncs * bytes per sync``, and the bytes per step
  are that over the steps taken: after whole intervals, ``bytes_per_interval
  / sync_every``. ``reduction`` compares it with data-parallel training's
  dense all-reduce (``dense_bytes``) of the same parameters on every step (the
  figure DiLoCo's "500x less communication" is).

  Args:
    opt_state: a global (not per-device) optimizer state holding one
      :func:`diloco`, as :func:`jaxcomp.init` and the train step return it.

  Returns:
    A :class:`LowCommTraffic` of Python numbers (it reads the state: call
    it outside ``jit``).

  Raises:
    ValueError: ``opt_state`` holds no :func:`diloco` state, or several.
  """
  st = _find(opt_state, DiLoCoState)
  steps = int(jax.device_get(st.step))
  syncs, per_interval, total, wire_total, dense = [], 0.0, 0.0, 0.0, 0.0
  for ex in st.exchange_state:
    # Each exchange state is one compressed_mean's: one exchange.
    stats = cast(transform.ExchangeStats, transform.get_stats(ex))
    n = int(jax.device_get(ex.count))
    b = float(jax.device_get(stats.bytes_sent))
    syncs.append(n)
    per_interval += b
    total += n * b
    wire_total += n * float(jax.device_get(stats.wire_bytes))
    dense += float(jax.device_get(stats.dense_bytes))
  per_step = total / steps if steps else 0.0
  return LowCommTraffic(
      steps=steps, syncs=tuple(syncs), bytes_per_interval=per_interval,
      total_bytes=total, total_wire_bytes=wire_total, bytes_per_step=per_step,
      dense_bytes_per_step=dense,
      reduction=dense / per_step if per_step else math.inf)


def synced_params(opt_state):
  """The synchronized parameters (the outer optimizer's, identical on every
  device) held in a state containing one :func:`diloco` (or
  :func:`jaxcomp.zero_one_adam`: the parameters at its last
  synchronisation)."""
  return _find(opt_state).anchor


def per_device_copies(params, mesh, axis_name: AxisName = "data"):
  """One copy of ``params`` per device of ``axis_name``: each leaf gets a
  leading axis of the group's size, sharded ``P(axis_name)`` (works on
  multi-process meshes: every process passes the same ``params``)."""
  n = wire.group_size(axis_name, dict(mesh.shape))
  # global_array, not device_put: it works on multi-process meshes too.
  return distributed.global_array(
      jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n, *jnp.shape(x))),
                   params), mesh, P(axis_name))


def holds_diloco(opt_state) -> bool:
  """Whether ``opt_state`` holds a :func:`diloco` state (or another state
  with one copy of the parameters per device: :func:`jaxcomp.zero_one_adam`'s)."""
  return bool(_diloco_states(opt_state))


def snap_to_anchor(params, opt_state):
  """Inside a per-device step, after ``optax.apply_updates``: the leaves
  that synchronized on this step set to the new anchor exactly (the update
  ``anchor - params`` lands within one float rounding of it)."""
  st = _find(opt_state)
  return jax.tree.map(lambda a, x, y: jnp.where(y, a.astype(x.dtype), x),
                      st.anchor, params, st.synced)

