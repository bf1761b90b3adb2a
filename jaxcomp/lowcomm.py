"""Low-communication training: DiLoCo with compressed pseudo-gradients.

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
:func:`init` and :func:`make_train_step`, or place them yourself with
``P(axis_name)``. After a sync every device holds the same parameters,
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

import math
import numbers
from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P
import optax

from jaxcomp import _mesh
from jaxcomp import sharding
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
     one float rounding; :func:`make_train_step` sets them to it exactly).

  With ``sync_every=1``, ``outer=optax.sgd(1.0)`` and an uncompressed mean,
  this is data-parallel training with ``inner`` applied to the mean of the
  per-device updates (for plain SGD: data-parallel SGD; tested).

  Bytes: one exchange per ``sync_every`` steps; ``get_stats`` reports the
  exchange's bytes (per sync), so a step averages ``bytes_sent /
  sync_every``; :func:`traffic` counts the run's total and per-step
  average from the state's counters.

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
      hyperparameters such as ``ratio`` or ``bits``, ...).

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
    >>> params, state, specs = jaxcomp.lowcomm.init(tx, {"w": jnp.ones(8)},
    ...                                            mesh)
    >>> params["w"].shape  # one copy per device
    (8, 8)
    >>> specs.anchor, specs.inner_state[0].trace  # shared; per device
    ({'w': P()}, {'w': P('data',)})
  """
  if (isinstance(sync_every, bool) or not isinstance(sync_every, numbers.Integral)
      or sync_every < 1):
    raise ValueError(f"sync_every must be an integer >= 1, got {sync_every=!r}")
  _mesh.check_axis_name(axis_name)
  if outer is None:
    outer = optax.sgd(0.7, momentum=0.9, nesterov=True)
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
  tau = int(overlap_steps)
  mean = transform.compressed_mean(compressor, axis_name,
                                   **compressed_mean_kwargs)
  # Fragment j syncs offsets[j] steps before the interval's end (Streaming
  # DiLoCo's staggered schedule).
  offsets = [j * sync_every // fragments for j in range(fragments)]

  def groups(leaves) -> list[list[int]]:
    """Leaf indices of each fragment: contiguous in ``jax.tree.leaves``
    order, of about equal size."""
    if len(leaves) < fragments:
      raise ValueError(f"fragments={fragments} needs as many parameter "
                       f"leaves; the parameters have {len(leaves)}")
    sizes = [int(jnp.size(x)) for x in leaves]
    prefix = [0]
    for n in sizes:
      prefix.append(prefix[-1] + n)
    starts = [0]
    for j in range(1, fragments):
      target = j * prefix[-1] / fragments
      i = next(i for i, c in enumerate(prefix) if c >= target)
      # Non-empty fragments: after the previous start, leaving one leaf
      # for every later fragment.
      starts.append(min(max(i, starts[-1] + 1), len(leaves) - (fragments - j)))
    starts.append(len(leaves))
    return [list(range(a, b)) for a, b in zip(starts, starts[1:])]

  def init_fn(params):
    anchor = jax.tree.map(jnp.asarray, params)
    a_leaves, p_leaves = jax.tree.leaves(anchor), jax.tree.leaves(params)
    frags = groups(a_leaves)
    return DiLoCoState(
        step=jnp.zeros((), jnp.int32), inner_state=inner.init(params),
        anchor=anchor,
        outer_state=tuple(outer.init([a_leaves[i] for i in g]) for g in frags),
        exchange_state=tuple(mean.init([p_leaves[i] for i in g]) for g in frags),
        synced=jax.tree.map(lambda _: jnp.zeros((), jnp.bool_), params),
        pending=tuple([jnp.zeros(jnp.shape(a_leaves[i]), jnp.result_type(a_leaves[i]))
                       for i in g] for g in frags) if tau else ())

  def delayed(j, g, sync, state, p_leaves, l_leaves, updates, anchor):
    """Fragment ``j`` with ``overlap_steps = tau > 0``: on its sync step,
    the exchange of ``anchor - params`` (the incoming parameters) into
    ``pending``; ``tau`` steps later, the outer step on it and the merge.
    Returns the fragment's anchor, outer, exchange and pending state, its
    leaves' updates, and whether its outer update landed this step."""
    step = state.step

    def exchange(args):
      exchange_state, pending = args
      pseudo = [(anchor[i] - p_leaves[i]).astype(jnp.result_type(p_leaves[i]))
                for i in g]
      avg, exchange_state = mean.update(pseudo, exchange_state,
                                        [p_leaves[i] for i in g])
      return exchange_state, [a.astype(x.dtype) for a, x in zip(avg, pending)]

    exchange_state, pending = lax.cond(
        sync, exchange, lambda args: args,
        (state.exchange_state[j], list(state.pending[j])))
    # The sync tau steps ago (never before the first one).
    landed = ((step + 1 + offsets[j] - tau) % sync_every == 0) & (step >= tau)

    def land(args):
      anchor_g, outer_state = args
      outer_updates, outer_state = outer.update(
          list(state.pending[j]), outer_state, anchor_g)
      anchor_g = optax.apply_updates(anchor_g, outer_updates)
      m = jnp.float32(merge)
      ups = [((m * l_leaves[i] + (1 - m) * a) - p_leaves[i]).astype(
          jnp.result_type(p_leaves[i])) for a, i in zip(anchor_g, g)]
      return ups, (anchor_g, outer_state)

    def keep(args):
      return [updates[i] for i in g], args

    ups, (anchor_g, outer_state) = lax.cond(
        landed, land, keep, ([anchor[i] for i in g], state.outer_state[j]))
    return anchor_g, outer_state, exchange_state, pending, ups, landed

  def update_fn(grads, state, params=None):
    if params is None:
      raise ValueError("diloco's update needs params (this device's own "
                       "parameters): tx.update(grads, state, params)")
    if _mesh.types_track_devices(axis_name) and any(
        not set(_mesh.axes(axis_name)) <= _mesh.varying_axes(p)
        for p in jax.tree.leaves(params)):
      raise ValueError(
          "diloco needs each device's own parameters, but these are "
          f"replicated over {axis_name!r} (identical on every device): place "
          "them with jaxcomp.lowcomm.init and step with "
          "jaxcomp.lowcomm.make_train_step (jaxcomp.lowcomm.local_step inside "
          "your own jax.jit step; jaxcomp.flax.Optimizer for NNX)")
    inner_updates, inner_state = inner.update(grads, state.inner_state, params)
    local = optax.apply_updates(params, inner_updates)
    p_leaves, treedef = jax.tree.flatten(params)
    l_leaves = treedef.flatten_up_to(local)
    updates = treedef.flatten_up_to(inner_updates)
    anchor = treedef.flatten_up_to(state.anchor)
    synced = [None] * len(p_leaves)
    outer_states, exchange_states, pendings = [], [], []
    for j, g in enumerate(groups(p_leaves)):
      sync = (state.step + 1 + offsets[j]) % sync_every == 0
      if tau:
        (anchor_g, outer_state, exchange_state, pending, ups,
         landed) = delayed(j, g, sync, state, p_leaves, l_leaves, updates, anchor)
        pendings.append(pending)
        for i, u, a in zip(g, ups, anchor_g):
          updates[i], anchor[i], synced[i] = u, a, landed & (merge == 0)
        outer_states.append(outer_state)
        exchange_states.append(exchange_state)
        continue

      def run(args, g=g):
        anchor_g, outer_state, exchange_state = args
        pseudo = [(a - l_leaves[i]).astype(jnp.result_type(l_leaves[i]))
                  for a, i in zip(anchor_g, g)]
        avg, exchange_state = mean.update(
            pseudo, exchange_state, [l_leaves[i] for i in g])
        outer_updates, outer_state = outer.update(avg, outer_state, anchor_g)
        anchor_g = optax.apply_updates(anchor_g, outer_updates)
        # Every device lands on the fragment's new anchor.
        ups = [(a - p_leaves[i]).astype(jnp.result_type(p_leaves[i]))
               for a, i in zip(anchor_g, g)]
        return ups, (anchor_g, outer_state, exchange_state)

      def wait(args, g=g):
        return [updates[i] for i in g], args

      ups, (anchor_g, outer_state, exchange_state) = lax.cond(
          sync, run, wait, ([anchor[i] for i in g], state.outer_state[j],
                            state.exchange_state[j]))
      for i, u, a in zip(g, ups, anchor_g):
        updates[i], anchor[i], synced[i] = u, a, sync
      outer_states.append(outer_state)
      exchange_states.append(exchange_state)
    unflat = lambda xs: jax.tree.unflatten(treedef, xs)
    return unflat(updates), DiLoCoState(
        step=state.step + 1, inner_state=inner_state, anchor=unflat(anchor),
        outer_state=tuple(outer_states),
        exchange_state=tuple(exchange_states), synced=unflat(synced),
        pending=tuple(pendings))

  return optax.GradientTransformation(init_fn, update_fn)


def _diloco_states(opt_state) -> list[DiLoCoState]:
  found = []
  jax.tree_util.tree_map(
      lambda x: found.append(x) if isinstance(x, DiLoCoState) else None,
      opt_state, is_leaf=lambda x: isinstance(x, DiLoCoState))
  return found


def _find(opt_state) -> DiLoCoState:
  found = _diloco_states(opt_state)
  if len(found) != 1:
    raise ValueError(f"expected one diloco state in opt_state, found {len(found)}")
  return found[0]


class LowCommTraffic(NamedTuple):
  """What a :func:`diloco` run has sent so far, per device (operand bytes,
  as :class:`jaxcomp.CompressionStats` counts them; wire bytes by the ring
  algorithms beside them). Read with :func:`traffic`."""

  steps: int  # inner steps taken
  syncs: tuple  # per fragment: its synchronizations so far
  bytes_per_interval: float  # one sync of every fragment: sync_every steps
  total_bytes: float  # sent in the run so far
  total_wire_bytes: float
  bytes_per_step: float  # total_bytes / steps: the interval's average
  dense_bytes_per_step: float  # data parallelism's dense all-reduce, each step
  reduction: float  # dense_bytes_per_step / bytes_per_step (inf before a sync)


def traffic(opt_state) -> LowCommTraffic:
  """Bytes a :func:`diloco` run has sent so far and per step on average.

  Each fragment's exchange runs only on its sync steps (inside the branch of
  the ``lax.cond``), so its :class:`jaxcomp.CompressionStats` give the bytes
  of *one* sync; the state's counters say how many there were. The total is
  ``sum over fragments of syncs * bytes per sync``, and the bytes per step
  are that over the steps taken: after whole intervals, ``bytes_per_interval
  / sync_every``. ``reduction`` compares it with data-parallel training's
  dense float32 all-reduce of the same parameters on every step (the
  figure DiLoCo's "500x less communication" is).

  Args:
    opt_state: a global (not per-device) optimizer state holding one
      :func:`diloco`, as :func:`init` and the train step return it.

  Returns:
    A :class:`LowCommTraffic` of Python numbers (it reads the state: call
    it outside ``jit``).

  Raises:
    ValueError: ``opt_state`` holds no :func:`diloco` state, or several.
  """
  st = _find(opt_state)
  steps = int(jax.device_get(st.step))
  syncs, per_interval, total, wire_total, dense = [], 0.0, 0.0, 0.0, 0.0
  for ex in st.exchange_state:
    stats = transform.get_stats(ex)
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
  device) held in a state containing one :func:`diloco`."""
  return _find(opt_state).anchor


def init(tx, params, mesh, axis_name: AxisName = "data"):
  """Initialises a state holding a :func:`diloco` transform and places one
  copy of ``params`` per device.

  Returns:
    ``(local_params, opt_state, specs)``: the parameters with a leading
    device axis sharded ``P(axis_name)`` (they differ between syncs), and
    the state and specs as :func:`jaxcomp.init_sharded` returns them.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``.
  """
  opt_state, specs = sharding.init_sharded(tx, params, mesh, axis_name)
  return per_device_copies(params, mesh, axis_name), opt_state, specs


def per_device_copies(params, mesh, axis_name: AxisName = "data"):
  """One copy of ``params`` per device of ``axis_name``: each leaf gets a
  leading axis of the group's size, sharded ``P(axis_name)`` (works on
  multi-process meshes: every process passes the same ``params``)."""
  n = wire.group_size(axis_name, dict(mesh.shape))
  from jaxcomp import distributed  # pylint: disable=g-import-not-at-top
  # global_array, not device_put: it works on multi-process meshes too.
  return distributed.global_array(
      jax.tree.map(lambda x: jnp.broadcast_to(x[None], (n, *jnp.shape(x))),
                   params), mesh, P(axis_name))


def holds_diloco(opt_state) -> bool:
  """Whether ``opt_state`` holds a :func:`diloco` state."""
  return bool(_diloco_states(opt_state))


def snap_to_anchor(params, opt_state):
  """Inside a per-device step, after ``optax.apply_updates``: the leaves
  that synchronized on this step set to the new anchor exactly (the update
  ``anchor - params`` lands within one float rounding of it)."""
  st = _find(opt_state)
  return jax.tree.map(lambda a, x, y: jnp.where(y, a.astype(x.dtype), x),
                      st.anchor, params, st.synced)


def _per_device_step(loss_fn: Callable, tx, *, mesh, state_specs,
                     axis_name: AxisName, batch_spec: Any, has_aux: bool,
                     per_device_loss: bool) -> Callable:
  """The DiLoCo step on global arrays (``shard_map``'d, not jitted)."""
  grad_fn = sharding.per_device_value_and_grad(loss_fn, axis_name,
                                               has_aux=has_aux)

  def step_fn(params, opt_state, batch):
    params = jax.tree.map(lambda x: x[0], params)
    out, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = snap_to_anchor(optax.apply_updates(params, updates), opt_state)
    return (jax.tree.map(lambda x: x[None], params), opt_state,
            sharding.step_loss(out, axis_name, per_device_loss))

  return sharding.shard_train_step(
      step_fn, mesh=mesh, state_specs=state_specs,
      batch_spec=P(axis_name) if batch_spec is None else batch_spec,
      params_spec=P(axis_name),
      out_aux_spec=P(axis_name) if per_device_loss else P())


def make_train_step(loss_fn: Callable, tx, *, mesh, state_specs,
                    axis_name: AxisName = "data", batch_spec: Any = None,
                    has_aux: bool = False, donate: bool = True,
                    per_device_loss: bool = False) -> Callable:
  """The DiLoCo train step, compiled: per device, its own gradient of its
  own parameters, ``tx``'s update (a sync every ``sync_every`` steps), the
  loss averaged.

  ``per_device_loss=True`` returns each device's own loss (shape ``(p,)``)
  instead of averaging it: the steps between syncs then run no collective
  at all, not even the loss's scalar all-reduce, so no device waits for
  another between syncs (what a run over slow or uneven links wants).

  Returns:
    ``step(local_params, opt_state, batch) -> (local_params, opt_state,
    loss)`` on the per-device parameters of :func:`init`.
  """
  step = _per_device_step(loss_fn, tx, mesh=mesh, state_specs=state_specs,
                          axis_name=axis_name, batch_spec=batch_spec,
                          has_aux=has_aux, per_device_loss=per_device_loss)
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())


class LocalStep:
  """DiLoCo for ``jax.jit`` steps: the per-device step as a function of
  global arrays, to call inside your own jitted step (the counterpart of
  :func:`jaxcomp.compressed_value_and_grad`, whose averaged gradient DiLoCo
  has none of: each device steps on its own gradient)::

    local_step = jaxcomp.lowcomm.local_step(loss_fn, tx, mesh)
    local, opt_state = local_step.init(params)

    @jax.jit
    def train_step(local, opt_state, batch):
      local, opt_state, loss = local_step(local, opt_state, batch)
      shared = jaxcomp.lowcomm.synced_params(opt_state)
      return local, opt_state, loss, ema_update(shared)   # your own code

  ``local`` holds one copy of the parameters per device (a leading device
  axis sharded ``P(axis_name)``); :func:`synced_params` reads the
  synchronized ones (replicated) anywhere in the step. Calling it runs
  exactly what :func:`make_train_step` compiles.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (this device's mean over
      its share of the batch), or ``(loss, aux)`` with ``has_aux``.
    tx: the optimizer holding one :func:`diloco` over ``axis_name``.
    mesh: the device mesh.
    axis_name: the data-parallel axis (or tuple of axes).
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    per_device_loss: return each device's own loss (shape ``(p,)``; no
      collective between syncs) instead of their mean.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; from ``init``,
      ``tx`` holds no :func:`diloco`.
  """

  def __init__(self, loss_fn: Callable, tx, mesh, *,
               axis_name: AxisName = "data", batch_spec: Any = None,
               has_aux: bool = False, per_device_loss: bool = False):
    sharding._check_mesh_axes(mesh, axis_name)  # pylint: disable=protected-access
    self.tx, self.mesh, self.axis_name = tx, mesh, axis_name
    self._kwargs = dict(loss_fn=loss_fn, tx=tx, mesh=mesh, axis_name=axis_name,
                        batch_spec=batch_spec, has_aux=has_aux,
                        per_device_loss=per_device_loss)
    self.specs = None
    self._step = None

  def init(self, params):
    """``(local_params, opt_state)`` for ``params``, placed on the mesh (see
    :func:`init`); keeps the state's partition specs for the step."""
    local, opt_state, self.specs = init(self.tx, params, self.mesh,
                                        self.axis_name)
    if not holds_diloco(opt_state):
      raise ValueError("jaxcomp.lowcomm.local_step needs a tx holding "
                       "jaxcomp.diloco(...); for a compressed data-parallel "
                       "step use jaxcomp.compressed_value_and_grad")
    self._step = _per_device_step(state_specs=self.specs, **self._kwargs)
    return local, opt_state

  def __call__(self, local_params, opt_state, batch):
    """``(local_params, opt_state, loss)`` after one step (a sync every
    ``sync_every`` steps)."""
    if self._step is None:
      raise ValueError("call init(params) first: it places the state on the "
                       "mesh and derives its partition specs")
    return self._step(local_params, opt_state, batch)


def local_step(loss_fn: Callable, tx, mesh, *, axis_name: AxisName = "data",
               batch_spec: Any = None, has_aux: bool = False,
               per_device_loss: bool = False) -> LocalStep:
  """:class:`LocalStep`: the DiLoCo step for your own ``jax.jit`` step."""
  return LocalStep(loss_fn, tx, mesh, axis_name=axis_name,
                   batch_spec=batch_spec, has_aux=has_aux,
                   per_device_loss=per_device_loss)


# -- DeMo -------------------------------------------------------------------


def _smaller_split(n: int, close_to: int) -> int:
  """The largest divisor of ``n`` not above ``close_to`` (``n`` itself when
  ``n <= close_to``): the DCT chunk of an axis of ``n`` (DeMo's
  ``_get_smaller_split``)."""
  if n <= close_to:
    return n
  return max(d for d in range(1, close_to + 1) if n % d == 0)


def _dct_matrix(n: int) -> jax.Array:
  """Orthonormal DCT-II basis: ``x @ m`` is the DCT of the rows of ``x``
  (``m.T`` inverts it)."""
  return jax.scipy.fft.dct(jnp.eye(n, dtype=jnp.float32), type=2,
                           norm="ortho", axis=-1)


class _Chunks(NamedTuple):
  """How one tensor is cut into DCT chunks (static)."""

  rows: int  # the tensor viewed as (rows, cols) (1-D: one row)
  cols: int
  h: int  # chunk size along rows and cols
  w: int
  k: int  # coefficients kept per chunk


def _chunks(shape, chunk: int, topk: int) -> _Chunks:
  if len(shape) <= 1:
    rows, cols = 1, (shape[0] if shape else 1)
    h = 1
  else:
    rows, cols = shape[0], math.prod(shape[1:])
    h = _smaller_split(rows, chunk)
  w = _smaller_split(cols, chunk)
  return _Chunks(rows, cols, h, w, max(1, min(topk, h * w)))


def _dct_encode(x, c: _Chunks):
  """``x`` as per-chunk DCT coefficients, ``(num_chunks, h * w)``."""
  x = x.reshape(c.rows // c.h, c.h, c.cols // c.w, c.w)
  y = jnp.einsum("ihjw,hb,wd->ijbd", x, _dct_matrix(c.h), _dct_matrix(c.w))
  return y.reshape(-1, c.h * c.w)


def _dct_decode(coef, c: _Chunks, shape):
  y = coef.reshape(c.rows // c.h, c.cols // c.w, c.h, c.w)
  x = jnp.einsum("ijbd,hb,wd->ihjw", y, _dct_matrix(c.h), _dct_matrix(c.w))
  return x.reshape(shape)


class DeMoState(NamedTuple):
  """State of :func:`demo`."""

  count: jax.Array  # shape=(), int32, steps taken
  delta: Any  # like the parameters, float32, per device: the momentum not yet sent
  stats: transform.CompressionStats  # read by jaxcomp.get_stats


def demo(learning_rate, *, compression_decay: float = 0.999,
         compression_topk: int = 32, compression_chunk: int = 64,
         weight_decay: float = 0.0,
         axis_name: AxisName = "data") -> optax.GradientTransformation:
  """DeMo, Decoupled Momentum optimization (Peng, Quesnelle & Kingma 2024):
  each device keeps its momentum, sends only its fast components, and steps
  by the sign of their average. A whole optimizer (no optimizer after it).

  Per device and tensor, inside ``jax.shard_map`` over ``axis_name``, with
  this device's own gradient ``g`` (the reference implementation's steps,
  ``bloc97/DeMo``'s ``demo.py``):

  1. ``delta = compression_decay * delta + lr * g`` (float32, per device);
  2. the tensor, viewed as ``(rows, cols)`` (a vector as one row; more axes
     folded into ``cols``), is cut into chunks of ``h x w``, ``h`` and ``w``
     the largest divisors of ``rows`` and ``cols`` not above
     ``compression_chunk``, and each chunk is DCT-II transformed (2-D,
     orthonormal);
  3. each chunk keeps its ``compression_topk`` largest coefficients by
     magnitude (values float32, indices int32);
  4. what they represent is subtracted from ``delta`` (the momentum not
     sent stays local);
  5. one all-gather per tensor of the values and indices; each coefficient
     is the mean over the devices that sent it (0 where none did), inverse
     DCT;
  6. update ``-lr * sign(that) - lr * weight_decay * params``.

  Bytes per device per step: ``8 * compression_topk`` per chunk (a 64 x 64
  chunk of float32 is 16,384 bytes: 64x fewer at the defaults), moved by
  all-gather.

  Args:
    learning_rate: a float or an ``optax`` schedule of the step count.
    compression_decay: the momentum's decay, in ``[0, 1)``.
    compression_topk: coefficients kept per chunk, >= 1.
    compression_chunk: the chunk size target per axis, >= 1.
    weight_decay: decoupled weight decay (needs ``params`` in ``update``).
    axis_name: the data-parallel axis.

  Returns:
    A ``GradientTransformation`` whose state is :class:`DeMoState`.

  Raises:
    ValueError: a hyperparameter out of range (named), at construction.

  References:
    Peng, Quesnelle & Kingma, DeMo: Decoupled Momentum Optimization
    <https://arxiv.org/abs/2411.19870>, 2024; reference implementation
    https://github.com/bloc97/DeMo (``demo.py``; defaults from its OLMo
    configurations: decay 0.999, top-k 32, chunk 64).
  """
  if not (isinstance(compression_decay, (int, float))
          and 0 <= compression_decay < 1):
    raise ValueError(f"compression_decay must be in [0, 1), got {compression_decay!r}")
  for name, v in (("compression_topk", compression_topk),
                  ("compression_chunk", compression_chunk)):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
  if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay)
          and weight_decay >= 0):
    raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
  _mesh.check_axis_name(axis_name)
  lr_fn = learning_rate if callable(learning_rate) else (lambda _: learning_rate)

  def stats(params, residual_norm):
    sizes = _mesh.axis_sizes(axis_name)
    ts = wire.transfers("all-gather", _demo_arrays(
        params, compression_topk, compression_chunk), axis_name, sizes)
    leaves = jax.tree.leaves(params)
    return transform.CompressionStats(
        **transform.traffic_stats(
            ts, wire.devices(sizes), exact_bytes=0,
            dense_bytes=sum(x.size * jnp.dtype(x.dtype).itemsize for x in leaves),
            dense_kind="all-reduce",
            state_bytes=4 * sum(x.size for x in leaves)),  # delta, float32
        residual_norm=residual_norm, skipped_steps=jnp.zeros((), jnp.int32))

  def init_fn(params):
    _mesh.check_bound(axis_name, "demo.init")
    delta = jax.tree.map(lambda p: jnp.zeros(jnp.shape(p), jnp.float32), params)
    delta = _mesh.to_varying(delta, axis_name)
    return DeMoState(count=jnp.zeros((), jnp.int32), delta=delta,
                     stats=stats(params, _mesh.varying_zeros((), axis_name)))

  def one(g, delta, p, lr):
    shape = jnp.shape(g)
    c = _chunks(shape, compression_chunk, compression_topk)
    delta = jnp.float32(compression_decay) * delta + lr * g.astype(jnp.float32)
    coef = _dct_encode(delta, c)
    _, idx = lax.top_k(jnp.abs(coef), c.k)
    idx = idx.astype(jnp.int32)
    val = jnp.take_along_axis(coef, idx, axis=-1)
    rows = jnp.arange(coef.shape[0])[:, None]
    sent = jnp.zeros_like(coef).at[rows, idx].set(val)
    delta = delta - _dct_decode(sent, c, shape)
    vals = lax.all_gather(val, axis_name, to="invarying")  # (p, chunks, k)
    idxs = lax.all_gather(idx, axis_name, to="invarying")
    # zeros, not zeros_like: the average is the same on every device.
    total = jnp.zeros(coef.shape, coef.dtype).at[rows[None], idxs].add(vals)
    count = jnp.zeros(coef.shape, coef.dtype).at[rows[None], idxs].add(1.0)
    mean = _dct_decode(total / jnp.maximum(count, 1.0), c, shape)
    update = -lr * jnp.sign(mean)
    if weight_decay:
      update = update - lr * jnp.float32(weight_decay) * p.astype(jnp.float32)
    return update.astype(jnp.result_type(g)), delta

  def update_fn(grads, state, params=None):
    if weight_decay and params is None:
      raise ValueError("demo(weight_decay=...) needs params in update")
    lr = jnp.asarray(lr_fn(state.count), jnp.float32)
    ps = grads if params is None else params
    out = jax.tree.map(lambda g, d, p: one(g, d, p, lr), grads, state.delta, ps)
    updates = jax.tree.map(lambda _, o: o[0], grads, out)
    delta = jax.tree.map(lambda _, o: o[1], grads, out)
    norm = jnp.sqrt(sum(jnp.sum(d * d) for d in jax.tree.leaves(delta)))
    return updates, DeMoState(count=state.count + 1, delta=delta,
                              stats=stats(grads, norm))

  return optax.GradientTransformation(init_fn, update_fn)


def demo_bytes(params, *, compression_topk: int = 32,
               compression_chunk: int = 64) -> int:
  """Bytes one device hands to :func:`demo`'s all-gathers per step for
  ``params`` (values float32 and indices int32, ``compression_topk`` per
  chunk)."""
  return sum(_demo_arrays(params, compression_topk, compression_chunk))


def _demo_arrays(params, topk: int, chunk: int) -> list[int]:
  """Bytes of each array :func:`demo` all-gathers per step: per tensor, its
  float32 values and int32 indices, ``topk`` per chunk."""
  return [4 * (c.rows // c.h) * (c.cols // c.w) * c.k
          for c in (_chunks(jnp.shape(p), chunk, topk)
                    for p in jax.tree.leaves(params)) for _ in range(2)]
