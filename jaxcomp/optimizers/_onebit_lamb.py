"""1-bit LAMB (Li et al., HiPC 2022) as an Optax transformation that owns
its exchange."""

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
from jaxcomp.optimizers._onebit_adam import is_number
from jaxcomp.optimizers._onebit_adam import leaf_facts


class OneBitLambState(NamedTuple):
  """State of :func:`onebit_lamb`. Per-leaf scalars are float32 ``()``
  leaves of a tree shaped like the parameters; all but the errors are the
  same on every device (invariant)."""

  count: jax.Array  # shape=(), int32, steps taken
  mu: Any  # like the parameters, float32: the momentum
  nu: Any  # like the parameters, float32: the variance, frozen after
  #          freeze_step steps
  nu_fresh: Any  # like the parameters, float32: the variance kept up
  #                after the freeze from the reconstructed gradient
  coeff_freeze: Any  # per leaf: the running mean of the warm-up's trust
  #                    ratios, the frozen LAMB coefficient
  last_factor: Any  # per leaf: the last step's scaling factor (starts 1)
  scaling_coeff: Any  # per leaf: the momentum's scaling for the fused
  #                     exchange, set at the first compressed step
  worker_error: tuple  # one float32 (N,): all leaves' momenta fused (N:
  #                      their total size rounded up to a multiple of
  #                      p * lcm(p, 8)), varying
  server_error: tuple  # one float32 (N / p,), varying
  stats: OneBitStats
  config: _exchange.OptimizerConfig = _exchange.OptimizerConfig()  # static:
  #   the hyperparameters (jaxcomp.optimizers.optimizer_configs)


@dataclasses.dataclass(frozen=True)
class _LambSpec:
  adam: AdamSpec
  max_coeff: float
  min_coeff: float
  coeff_beta: float
  factor_max: float
  factor_min: float
  factor_threshold: float


def _init(spec: _LambSpec, params) -> OneBitLambState:
  axis_name = spec.adam.axis_name
  _mesh.check_bound(axis_name, "onebit_lamb.init")
  nbytes, sizes = leaf_facts(params)
  zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)
  scalar = lambda v: jax.tree.map(lambda _: jnp.float32(v), params)
  worker, server = _exchange.init_errors([sum(sizes)], axis_name)
  return OneBitLambState(
      count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros, nu_fresh=zeros,
      coeff_freeze=scalar(0.0), last_factor=scalar(1.0),
      scaling_coeff=scalar(1.0), worker_error=worker, server_error=server,
      stats=_exchange.init_stats(nbytes, [sum(sizes)], axis_name,
                                 (worker, server)))


def _norm(x: jax.Array) -> jax.Array:
  return jnp.sqrt(jnp.sum(x * x))


def _warmup(spec: _LambSpec, count, g_leaves, p_leaves, s):
  """One warm-up step: dense mean, Adam's moments, LAMB's clipped trust
  ratio per leaf (its running mean is the coefficient frozen later).
  Returns the per-leaf steps (before ``-lr``) and the new ``s``."""
  a = spec.adam
  b1, b2 = a.b1, a.b2
  g = [lax.pmean(x, a.axis_name).astype(jnp.float32) for x in g_leaves]
  mu = [b1 * m + (1 - b1) * x for m, x in zip(s["mu"], g)]
  nu = [b2 * v + (1 - b2) * x * x for v, x in zip(s["nu"], g)]
  last = count + 1 == a.freeze_step
  fresh = [jnp.where(last, v, f) for v, f in zip(nu, s["nu_fresh"])]
  steps, cf = [], []
  for m, v, p, c in zip(mu, nu, p_leaves, s["coeff_freeze"]):
    update = m / (jnp.sqrt(v) + jnp.float32(a.eps)) + jnp.float32(
        a.weight_decay) * p
    w_norm, u_norm = _norm(p), _norm(update)
    coeff = jnp.where((w_norm != 0) & (u_norm != 0), jnp.clip(
        w_norm / jnp.where(u_norm != 0, u_norm, jnp.float32(1)),
        spec.min_coeff, spec.max_coeff), jnp.float32(1))
    cf.append(jnp.where(coeff != 1, spec.coeff_beta * c
                        + (1 - spec.coeff_beta) * coeff, c))
    steps.append(coeff * update)
  return steps, dict(s, mu=mu, nu=nu, nu_fresh=fresh, coeff_freeze=cf)


def _compressed(spec: _LambSpec, count, g_leaves, p_leaves, s):
  """One compression step: local momenta scaled to a common size, fused
  and 1-bit averaged; the frozen coefficient times a bounded factor from
  the variance kept up on the side."""
  a = spec.adam
  b1, b2, eps = a.b1, a.b2, jnp.float32(a.eps)
  last_mu = s["mu"]
  # The momenta's scales at the end of the warm-up, set once.
  rms = [_norm(m) / jnp.float32(max(m.size, 1) ** 0.5) for m in last_mu]
  united = sum(rms) / jnp.float32(len(rms))
  first = count == a.freeze_step
  # (A layer whose momentum is all zero keeps the scaling 1.)
  scaling = [jnp.where(first, jnp.where(
      r != 0, united / jnp.where(r != 0, r, jnp.float32(1)), jnp.float32(1)),
      c) for r, c in zip(rms, s["scaling_coeff"])]
  local = [(b1 * m + (1 - b1) * x.astype(jnp.float32)) * c
           for m, x, c in zip(last_mu, g_leaves, scaling)]
  sizes = [x.size for x in local]
  means, worker, server = _exchange.compressed_allreduce(
      [jnp.concatenate([x.reshape(-1) for x in local])],
      s["worker_error"], s["server_error"], a.axis_name)
  offsets = [sum(sizes[:i]) for i in range(len(sizes))]
  mu = [means[0][o:o + n].reshape(x.shape) / c
        for o, n, x, c in zip(offsets, sizes, local, scaling)]
  steps, fresh, factors, wd = [], [], [], jnp.float32(a.weight_decay)
  for m, m0, v, f, p, lf, cf in zip(mu, last_mu, s["nu"], s["nu_fresh"],
                                    p_leaves, s["last_factor"],
                                    s["coeff_freeze"]):
    g = (m - m0 * b1) / (1 - b1)
    f = b2 * f + (1 - b2) * g * g
    denom = jnp.sqrt(v) + eps
    prelim = m / denom
    update = prelim + wd * p
    factor = jnp.max(denom / (jnp.sqrt(f) + eps))
    if a.weight_decay:
      u_norm = _norm(update)
      ratio = jnp.minimum(jnp.float32(1), _norm(prelim) / jnp.where(
          u_norm != 0, u_norm, jnp.float32(1)))
      factor = factor * ratio + (1 - ratio)
    factor = jnp.clip(factor, spec.factor_min, spec.factor_max)
    factor = jnp.clip(factor, lf * (1 - spec.factor_threshold),
                      lf * (1 + spec.factor_threshold))
    steps.append(cf * factor * update)
    fresh.append(f)
    factors.append(factor)
  return steps, dict(s, mu=mu, nu_fresh=fresh, last_factor=factors,
                     scaling_coeff=scaling, worker_error=worker,
                     server_error=server)


def _update(spec: _LambSpec, updates, state: OneBitLambState, params=None):
  if params is None:
    raise ValueError("onebit_lamb's update needs params (the trust ratio "
                     "reads them): tx.update(grads, state, params)")
  a = spec.adam
  _mesh.check_bound(a.axis_name, "onebit_lamb.update")
  g_leaves, treedef = jax.tree.flatten(updates)
  check_per_device(g_leaves, a.axis_name, "onebit_lamb")
  p_leaves = [jnp.asarray(x).astype(jnp.float32)
              for x in treedef.flatten_up_to(params)]
  flat = lambda tree: treedef.flatten_up_to(tree)
  s = dict(mu=flat(state.mu), nu=flat(state.nu),
           nu_fresh=flat(state.nu_fresh),
           coeff_freeze=flat(state.coeff_freeze),
           last_factor=flat(state.last_factor),
           scaling_coeff=flat(state.scaling_coeff),
           worker_error=tuple(state.worker_error),
           server_error=tuple(state.server_error))
  frozen = state.count >= a.freeze_step
  steps, s = _mesh.cond(
      frozen,
      lambda s: _compressed(spec, state.count, g_leaves, p_leaves, s),
      lambda s: _warmup(spec, state.count, g_leaves, p_leaves, s), s)
  lr = a.lr(state.count)
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)
  return unflat([(-lr * d).astype(x.dtype) for d, x in zip(steps, g_leaves)]
                ), OneBitLambState(
      config=state.config,
      count=state.count + 1, mu=unflat(s["mu"]), nu=unflat(s["nu"]),
      nu_fresh=unflat(s["nu_fresh"]),
      coeff_freeze=unflat(s["coeff_freeze"]),
      last_factor=unflat(s["last_factor"]),
      scaling_coeff=unflat(s["scaling_coeff"]),
      worker_error=tuple(s["worker_error"]),
      server_error=tuple(s["server_error"]),
      stats=_exchange.count(state.stats, ~frozen, frozen))


def onebit_lamb(learning_rate: float | Callable = 1e-3, *,
                axis_name: AxisName = "data", freeze_step: int,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, max_coeff: float = 10.0,
                min_coeff: float = 0.01, coeff_beta: float = 0.9,
                factor_max: float = 4.0, factor_min: float = 0.5,
                factor_threshold: float = 0.1, nonfinite: str = "skip"
                ) -> optax.GradientTransformation:
  """1-bit LAMB: dense LAMB for ``freeze_step`` steps, then the variance and
  the per-layer LAMB coefficients frozen and the momentum averaged by a
  1-bit compressed all-reduce.

  Each leaf is a layer. Run inside ``jax.shard_map`` over ``axis_name``
  with each device's own gradient (:func:`jaxcomp.make_train_step`), with
  no ``compressed_mean`` before it. Per step ``t`` (from 0), float32, as
  DeepSpeed's ``OnebitLamb``:

  * warm-up, ``t < freeze_step``: ``g = pmean(g_i)``, Adam's ``m`` and
    ``v`` (no bias correction), ``u = m / (sqrt(v) + eps) + weight_decay
    * x``, the trust ratio ``c = clip(||x|| / ||u||, min_coeff,
    max_coeff)`` (1 where a norm is 0) and the step ``-lr c u``; the
    frozen coefficient is the running mean ``c_f = coeff_beta c_f + (1 -
    coeff_beta) c`` (where ``c != 1``). At the last warm-up step the
    "fresh" variance starts as ``v``.
  * compression: at its first step each layer's momentum scale ``||m|| /
    sqrt(size)`` is fixed and ``s = mean of the scales / own scale``;
    every step ``m_i = s (b1 m + (1 - b1) g_i)``, all layers fused into
    one buffer and 1-bit averaged (worker and server error), ``m = C(m_i)
    / s``; the gradient reconstructed from it, ``(m - b1 m_prev) / (1 -
    b1)``, keeps the fresh variance ``v_f`` up; the step is ``-lr c_f f
    u`` with ``u`` from the frozen ``v`` and the factor ``f = max(
    (sqrt(v) + eps) / (sqrt(v_f) + eps))`` (mixed towards 1 by ``||m /
    (sqrt(v) + eps)|| / ||u||`` with weight decay), clipped to
    ``[factor_min, factor_max]`` and to within ``factor_threshold`` of
    the last step's.

  Args:
    learning_rate: a number, or an optax schedule of the step count.
    axis_name: the data-parallel mesh axis (or axes).
    freeze_step: warm-up steps of dense LAMB, an integer >= 1 (DeepSpeed:
      ``1 / (1 - coeff_beta)`` should not exceed it).
    b1, b2: Adam's decays, in [0, 1).
    eps: added to ``sqrt(v)``, >= 0.
    weight_decay: added to the update times the parameters, >= 0.
    max_coeff, min_coeff: the trust ratio's bounds, ``0 < min_coeff <=
      max_coeff``.
    coeff_beta: the decay of the coefficients' running mean, in [0, 1).
    factor_max, factor_min: the factor's bounds, ``0 < factor_min <= 1 <=
      factor_max``.
    factor_threshold: how far the factor may move in one step, in [0, 1).
    nonfinite: what a NaN or Inf in any device's gradient does:
      ``"skip"`` (default) the step returns zero updates and leaves the
      whole state (errors, momentum, counters) as it was, on every device,
      but for one more ``stats.skipped_steps`` (``get_stats``'
      ``skipped_steps``), at the cost of one 4-byte all-reduce per step
      (not in the byte counts); ``"none"`` no check.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`OneBitLambState`; ``update`` needs ``params``.

  Raises:
    ValueError: at construction, for a bad argument (named in the
      message); in ``update``, without ``params``.
    TypeError: in ``update``, for a gradient already summed over the
      devices.
    NameError: ``init``/``update`` outside ``shard_map`` over
      ``axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.onebit_lamb(1e-2, axis_name="data", freeze_step=2)
    >>> state = jaxcomp.init(tx, {"w": jnp.ones((64,))}, mesh)
    >>> step = jaxcomp.make_train_step(
    ...     lambda p, x: jnp.sum((p["w"] - x[0]) ** 2), tx, mesh=mesh)
    >>> batch = jax.device_put(jnp.zeros((jax.device_count(), 64)),
    ...                        NamedSharding(mesh, P("data")))
    >>> for _ in range(4):  # two dense warm-up steps, two 1-bit ones
    ...   state, loss = step(state, batch)
    >>> t = jaxcomp.get_stats(state.opt_state)  # a OneBitTraffic
    >>> t.dense_steps, t.compressed_steps
    (2, 2)

  References:
    Li et al., 1-bit LAMB: Communication Efficient Large-Scale
    Large-Batch Training with LAMB's Convergence Speed
    <https://arxiv.org/abs/2104.06069>, HiPC 2022; You et al., Large Batch
    Optimization for Deep Learning: Training BERT in 76 minutes
    <https://arxiv.org/abs/1904.00962>, ICLR 2020 (LAMB); DeepSpeed,
    ``deepspeed/runtime/fp16/onebit/lamb.py``.
  """
  check_adam_args(learning_rate, axis_name, b1, b2, eps, weight_decay)
  for name, v, ok, what in (
      ("min_coeff", min_coeff, lambda v: v > 0, "> 0"),
      ("max_coeff", max_coeff, lambda v: v >= min_coeff,
       f">= min_coeff={min_coeff!r}"),
      ("coeff_beta", coeff_beta, lambda v: 0 <= v < 1, "in [0, 1)"),
      ("factor_min", factor_min, lambda v: 0 < v <= 1, "in (0, 1]"),
      ("factor_max", factor_max, lambda v: v >= 1, ">= 1"),
      ("factor_threshold", factor_threshold, lambda v: 0 <= v < 1,
       "in [0, 1)")):
    if not is_number(v) or not ok(v):
      raise ValueError(f"{name} must be a number {what}, got {name}={v!r}")
  spec = _LambSpec(
      adam=AdamSpec(learning_rate=learning_rate, axis_name=axis_name,
                    freeze_step=check_step("freeze_step", freeze_step),
                    b1=float(b1), b2=float(b2), eps=float(eps),
                    weight_decay=float(weight_decay)),
      max_coeff=float(max_coeff), min_coeff=float(min_coeff),
      coeff_beta=float(coeff_beta), factor_max=float(factor_max),
      factor_min=float(factor_min), factor_threshold=float(factor_threshold))
  return _exchange.transformation("onebit_lamb", spec, _init, _update, axis_name,
                                 nonfinite)
