"""0/1 Adam (Lu et al., ICLR 2023) as an Optax transformation that owns its
exchange: adaptive variance freezing and 1-bit synchronisation with local
steps."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp import _mesh
from jaxcomp._mesh import AxisName
from jaxcomp.optimizers import _exchange
from jaxcomp.transform import OneBitStats
from jaxcomp.optimizers._onebit_adam import AdamSpec
from jaxcomp.optimizers._onebit_adam import check_adam_args
from jaxcomp.optimizers._onebit_adam import check_per_device
from jaxcomp.optimizers._onebit_adam import check_step
from jaxcomp.optimizers._onebit_adam import leaf_facts


class ZeroOneAdamState(NamedTuple):
  """State of :func:`zero_one_adam`."""

  count: jax.Array  # shape=(), int32, steps taken
  mu: Any  # like the parameters, float32: the momentum, this device's
  #          between synchronisations (varying)
  mu_synced: Any  # like the parameters, float32: the momentum as of the
  #                 last exchange, the same on every device (invariant)
  nu: Any  # like the parameters, float32: the variance (invariant)
  accumulator: Any  # like the parameters, float32: this device's steps
  #                   since the last synchronisation (the paper's u)
  lrs: jax.Array  # shape=(), float32, learning rates summed since then
  var_interval: jax.Array  # shape=(), int32, steps between variance updates
  var_counter: jax.Array  # shape=(), int32, variance updates at it
  local_interval: jax.Array  # shape=(), int32, steps between syncs
  local_counter: jax.Array  # shape=(), int32, steps at it
  anchor: Any  # like the parameters: the parameters at the last
  #              synchronisation, the same on every device (invariant)
  synced: Any  # like the parameters, bool scalars: synchronised last step
  worker_error: tuple  # per leaf, float32 (N_i,), varying
  server_error: tuple  # per leaf, float32 (N_i / p,), varying
  stats: OneBitStats
  config: _exchange.OptimizerConfig = _exchange.OptimizerConfig()  # static:
  #   the hyperparameters (jaxcomp.optimizers.optimizer_configs)


@dataclasses.dataclass(frozen=True)
class _Spec:
  adam: AdamSpec  # freeze_step: var_freeze_step
  var_update_scaler: int
  local_step_scaler: int
  local_step_clipper: int


def _init(spec: _Spec, params) -> ZeroOneAdamState:
  axis_name = spec.adam.axis_name
  _mesh.check_bound(axis_name, "zero_one_adam.init")
  nbytes, sizes = leaf_facts(params)
  zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)
  worker, server = _exchange.init_errors(sizes, axis_name)
  one = jnp.ones((), jnp.int32)
  return ZeroOneAdamState(
      count=jnp.zeros((), jnp.int32), mu=zeros, mu_synced=zeros, nu=zeros,
      accumulator=zeros,
      lrs=jnp.zeros((), jnp.float32), var_interval=one,
      var_counter=jnp.zeros((), jnp.int32), local_interval=one,
      local_counter=jnp.zeros((), jnp.int32),
      anchor=jax.tree.map(jnp.asarray, params),
      synced=jax.tree.map(lambda _: jnp.zeros((), jnp.bool_), params),
      worker_error=worker, server_error=server,
      stats=_exchange.init_stats(nbytes, sizes, axis_name, (worker, server)))


def _flat_allreduce(xs, worker, server, axis_name):
  means, worker, server = _exchange.compressed_allreduce(
      [x.reshape(-1) for x in xs], worker, server, axis_name)
  return ([m.reshape(x.shape) for m, x in zip(means, xs)], list(worker),
          list(server))


def _variance_phase(spec: _Spec, dense, g, lr, p_leaves, s):
  """A step before the freeze: the gradient averaged densely (a variance
  step, which updates ``v`` too) or by the 1-bit all-reduce; every device
  takes the same step from the anchor (all from invariant values, so that
  the anchor stays typed the same on every device)."""
  a = spec.adam
  b1, b2 = a.b1, a.b2

  def variance(s):
    mean = [lax.pmean(x, a.axis_name).astype(jnp.float32) for x in g]
    return dict(s, mu_synced=[b1 * m + (1 - b1) * x
                              for m, x in zip(s["mu_synced"], mean)],
                nu=[b2 * v + (1 - b2) * x * x for v, x in zip(s["nu"], mean)])

  def onebit(s):
    mean, worker, server = _flat_allreduce(
        [x.astype(jnp.float32) for x in g], s["worker"], s["server"],
        a.axis_name)
    return dict(s, mu_synced=[b1 * m + (1 - b1) * x
                              for m, x in zip(s["mu_synced"], mean)],
                worker=worker, server=server)

  s = _mesh.cond(dense, variance, onebit, s)
  eps, wd = jnp.float32(a.eps), jnp.float32(a.weight_decay)
  anchor = [x + (-lr * (m / (jnp.sqrt(v) + eps) + wd * x))
            for x, m, v in zip(s["anchor"], s["mu_synced"], s["nu"])]
  return ([x - p for x, p in zip(anchor, p_leaves)],
          dict(s, mu=s["mu_synced"], anchor=anchor,
               synced=[jnp.bool_(True)] * len(anchor)))


def _local_phase(spec: _Spec, sync, g, lr, p_leaves, s):
  """A step after the freeze: a local step from this device's momentum;
  on a sync step, the steps since the last one (times ``sqrt(v) + eps``)
  1-bit averaged, the momentum re-derived from them and every device set
  to the anchor plus their average."""
  a = spec.adam
  b1, eps, wd = a.b1, jnp.float32(a.eps), jnp.float32(a.weight_decay)
  mu = [b1 * m + (1 - b1) * x.astype(jnp.float32) for m, x in zip(s["mu"], g)]
  denom = [jnp.sqrt(v) + eps for v in s["nu"]]
  steps = [-lr * (m / d + wd * p) for m, d, p in zip(mu, denom, p_leaves)]
  s = dict(s, mu=mu, acc=[u + x for u, x in zip(s["acc"], steps)],
           lrs=s["lrs"] + lr)

  def synchronise(s):
    avg, worker, server = _flat_allreduce(
        [u * d for u, d in zip(s["acc"], denom)], s["worker"], s["server"],
        a.axis_name)
    anchor = [x + c / d for x, c, d in zip(s["anchor"], avg, denom)]
    mu = [-c / s["lrs"] for c in avg]
    return ([x - p for x, p in zip(anchor, p_leaves)], dict(
        s, mu=mu, mu_synced=mu, anchor=anchor,
        acc=[jnp.zeros_like(u) for u in s["acc"]],
        lrs=jnp.zeros((), jnp.float32), worker=worker, server=server,
        synced=[jnp.bool_(True)] * len(avg)))

  def local(s):
    return steps, dict(s, synced=[jnp.bool_(False)] * len(steps))

  return _mesh.cond(sync, synchronise, local, s)


def _schedules(spec: _Spec, state: ZeroOneAdamState, frozen, var_step):
  """The intervals after this step: the variance's doubles after every
  ``var_update_scaler`` updates at it, the syncs' after every
  ``local_step_scaler`` frozen steps, up to ``local_step_clipper``."""
  var_counter = state.var_counter + var_step.astype(jnp.int32)
  roll = var_step & (var_counter == spec.var_update_scaler)
  local_counter = state.local_counter + frozen.astype(jnp.int32)
  roll2 = frozen & (local_counter == spec.local_step_scaler)
  return dict(
      var_counter=jnp.where(roll, 0, var_counter),
      var_interval=jnp.where(roll, 2 * state.var_interval, state.var_interval),
      local_counter=jnp.where(roll2, 0, local_counter),
      local_interval=jnp.where(roll2, jnp.minimum(
          spec.local_step_clipper, 2 * state.local_interval),
                               state.local_interval))


def _update(spec: _Spec, updates, state: ZeroOneAdamState, params=None):
  if params is None:
    raise ValueError("zero_one_adam's update needs params (this device's "
                     "own): tx.update(grads, state, params)")
  a = spec.adam
  _mesh.check_bound(a.axis_name, "zero_one_adam.update")
  g, treedef = jax.tree.flatten(updates)
  check_per_device(g, a.axis_name, "zero_one_adam")
  flat = treedef.flatten_up_to
  p_leaves = [jnp.asarray(x).astype(jnp.float32) for x in flat(params)]
  k = state.count + 1  # this step, from 1
  frozen = k > a.freeze_step
  var_step = ~frozen & (k % state.var_interval == 0)
  sync = frozen & (k % state.local_interval == 0)
  # The errors served gradients before the freeze, accumulated steps
  # after it: they start again from zero (DeepSpeed's
  # reinitial_error_buffer).
  restart = k == a.freeze_step + 1
  s = dict(mu=flat(state.mu), mu_synced=flat(state.mu_synced),
           nu=flat(state.nu), acc=flat(state.accumulator),
           lrs=state.lrs, anchor=[jnp.asarray(x).astype(jnp.float32)
                                  for x in flat(state.anchor)],
           synced=flat(state.synced),
           worker=[jnp.where(restart, 0, e) for e in state.worker_error],
           server=[jnp.where(restart, 0, e) for e in state.server_error])
  lr = a.lr(state.count)
  steps, s = _mesh.cond(
      frozen, lambda s: _local_phase(spec, sync, g, lr, p_leaves, s),
      lambda s: _variance_phase(spec, var_step, g, lr, p_leaves, s), s)
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)
  compressed = (~frozen & ~var_step) | sync
  return unflat([d.astype(x.dtype) for d, x in zip(steps, g)]
                ), ZeroOneAdamState(
      config=state.config,
      count=k, mu=unflat(s["mu"]), mu_synced=unflat(s["mu_synced"]),
      nu=unflat(s["nu"]),
      accumulator=unflat(s["acc"]), lrs=s["lrs"],
      anchor=unflat([x.astype(jnp.result_type(y)) for x, y in
                     zip(s["anchor"], flat(state.anchor))]),
      synced=unflat(s["synced"]), worker_error=tuple(s["worker"]),
      server_error=tuple(s["server"]),
      stats=_exchange.count(state.stats, var_step, compressed),
      **_schedules(spec, state, frozen, var_step))


def zero_one_adam(learning_rate: float | Callable = 1e-3, *,
                  axis_name: AxisName = "data", var_freeze_step: int,
                  var_update_scaler: int = 16, local_step_scaler: int = 32678,
                  local_step_clipper: int = 16, b1: float = 0.9,
                  b2: float = 0.999, eps: float = 1e-8,
                  weight_decay: float = 0.0, nonfinite: str = "skip"
                  ) -> optax.GradientTransformation:
  """0/1 Adam: Adam whose variance is updated at exponentially spaced
  steps and then frozen, with 1-bit exchanges in between and local steps
  whose number between synchronisations grows.

  Between synchronisations each device's parameters move on their own, so
  0/1 Adam runs with one copy of the parameters per device:
  :func:`jaxcomp.init` and :func:`jaxcomp.make_train_step` with
  ``layout=jaxcomp.Islands()``; :func:`jaxcomp.lowcomm.synced_params` (or
  ``state.model_params()``) is the last synchronised copy. Per step ``k``
  (from 1), float32, as DeepSpeed's ``ZeroOneAdam`` (its step counter
  also counts its set-up call, one ahead of ``k``):

  * ``k <= var_freeze_step``: on a variance step (``k`` a multiple of the
    variance interval, 1 at first, doubled after every
    ``var_update_scaler`` variance steps) the gradient is averaged densely
    and ``m``, ``v`` take Adam's updates; on the other steps it is averaged
    by the 1-bit all-reduce (worker and server error, as
    :func:`onebit_adam`'s) and only ``m`` moves. The step ``-lr (m /
    (sqrt(v) + eps) + weight_decay x)`` is the same on every device.
  * ``k > var_freeze_step``: ``v`` is frozen (and the errors restart from
    zero). Each device updates ``m`` from its own gradient and takes the
    step locally, adding it to its accumulator ``u`` and the learning rate
    to ``lrs``. When ``k`` is a multiple of the local interval (1 at
    first, doubled after every ``local_step_scaler`` frozen steps, at most
    ``local_step_clipper``), ``u (sqrt(v) + eps)`` is 1-bit averaged into
    ``c``, every device's parameters become the last synchronised ones
    plus ``c / (sqrt(v) + eps)``, ``m = -c / lrs``, and ``u``, ``lrs``
    restart. The other steps send nothing (the paper's skipped rounds).

  Bytes: :func:`jaxcomp.get_stats` (dense variance steps, 1-bit
  exchanges, and the steps that sent nothing: ``count`` minus both).

  The learning rate: as DeepSpeed's, there is no bias correction, and the
  variance is frozen after few updates when ``var_freeze_step`` is short
  (87 updates by step 720 at ``var_update_scaler=16``), so ``v`` holds
  about ``1 - b2**updates`` of the gradient's second moment and each step
  is larger than Adam's at the same rate (about 3.5x there). On the
  character LM of docs/optimizers.md, Adam's tuned 3e-3 ended 14.5% above
  Adam's validation loss and 1e-3 within 2.5%.

  Args:
    learning_rate: a number, or an optax schedule of the step count.
    axis_name: the data-parallel mesh axis (or axes).
    var_freeze_step: the last step that may update the variance, an
      integer >= 1 (DeepSpeed: the end of the learning-rate warm-up).
    var_update_scaler: variance steps at an interval before it doubles
      (the paper's kappa), an integer >= 1.
    local_step_scaler: frozen steps at a local interval before it
      doubles, an integer >= 1.
    local_step_clipper: the longest local interval (the paper's H), an
      integer >= 1.
    b1, b2: Adam's decays, in [0, 1).
    eps: added to ``sqrt(v)``, >= 0.
    weight_decay: added to the update times the parameters, >= 0.
    nonfinite: what a NaN or Inf in any device's gradient does:
      ``"skip"`` (default) the step returns zero updates and leaves the
      whole state (errors, momentum, counters) as it was, on every device,
      but for one more ``stats.skipped_steps`` (``get_stats``'
      ``skipped_steps``), at the cost of one 4-byte all-reduce per step
      (not in the byte counts); ``"none"`` no check.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`ZeroOneAdamState`; ``update`` needs ``params`` (this device's).

  Raises:
    ValueError: at construction, for a bad argument (named in the
      message); in ``update``, without ``params``; in
      :func:`jaxcomp.init`, without ``layout=jaxcomp.Islands()``.
    TypeError: in ``update``, for a gradient already summed over the
      devices.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.zero_one_adam(1e-2, axis_name="data", var_freeze_step=4,
    ...                            local_step_scaler=2, local_step_clipper=4)
    >>> islands = jaxcomp.Islands()
    >>> state = jaxcomp.init(tx, {"w": jnp.ones((64,))}, mesh, layout=islands)
    >>> step = jaxcomp.make_train_step(
    ...     lambda p, x: jnp.sum((p["w"] - x[0]) ** 2), tx, mesh=mesh,
    ...     layout=islands)
    >>> batch = jax.device_put(jnp.zeros((jax.device_count(), 64)),
    ...                        NamedSharding(mesh, P("data")))
    >>> for _ in range(12):
    ...   state, loss = step(state, batch)
    >>> t = jaxcomp.get_stats(state.opt_state)  # a OneBitTraffic
    >>> t.dense_steps, t.compressed_steps  # 4 variance steps; syncs at 5, 6, 8, 12
    (4, 4)
    >>> t.silent_steps  # the local steps between the syncs
    4

  References:
    Lu et al., Maximizing Communication Efficiency for Large-scale
    Training via 0/1 Adam <https://arxiv.org/abs/2202.06009>, ICLR 2023;
    DeepSpeed, ``deepspeed/runtime/fp16/onebit/zoadam.py``.
  """
  check_adam_args(learning_rate, axis_name, b1, b2, eps, weight_decay)
  spec = _Spec(
      adam=AdamSpec(learning_rate=learning_rate, axis_name=axis_name,
                    freeze_step=check_step("var_freeze_step", var_freeze_step),
                    b1=float(b1), b2=float(b2), eps=float(eps),
                    weight_decay=float(weight_decay)),
      var_update_scaler=check_step("var_update_scaler", var_update_scaler),
      local_step_scaler=check_step("local_step_scaler", local_step_scaler),
      local_step_clipper=check_step("local_step_clipper", local_step_clipper))
  return _exchange.transformation("zero_one_adam", spec, _init, _update, axis_name,
                                 nonfinite)
