"""1-bit Adam (Tang et al., ICML 2021) as an Optax transformation that owns
its exchange."""

from __future__ import annotations

import dataclasses
import numbers
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


class OneBitAdamState(NamedTuple):
  """State of :func:`onebit_adam`."""

  count: jax.Array  # shape=(), int32, steps taken
  mu: Any  # like the parameters, float32: the momentum (invariant: the
  #          average every device holds after each exchange)
  nu: Any  # like the parameters, float32: the variance, frozen after
  #          freeze_step steps (invariant)
  worker_error: tuple  # per leaf, float32 (N_i,): this device's
  #                      compression error (N_i: the leaf's size rounded up
  #                      to a multiple of p * lcm(p, 8)), varying
  server_error: tuple  # per leaf, float32 (N_i / p,): the error of the
  #                      chunk this device reduces, varying
  stats: OneBitStats
  config: _exchange.OptimizerConfig = _exchange.OptimizerConfig()  # static:
  #   the hyperparameters (jaxcomp.optimizers.optimizer_configs)


@dataclasses.dataclass(frozen=True)
class AdamSpec:
  """The checked arguments of a DeepSpeed-style Adam."""

  learning_rate: float | Callable
  axis_name: AxisName
  freeze_step: int
  b1: float
  b2: float
  eps: float
  weight_decay: float

  def lr(self, count) -> jax.Array:
    lr = self.learning_rate
    return jnp.asarray(lr(count) if callable(lr) else lr, jnp.float32)


def is_number(x) -> bool:
  return isinstance(x, numbers.Real) and not isinstance(x, bool)


def check_adam_args(learning_rate, axis_name, b1, b2, eps,
                    weight_decay) -> None:
  """Raises ValueError naming the first bad argument."""
  if not callable(learning_rate) and not (
      is_number(learning_rate) and learning_rate >= 0):
    raise ValueError("learning_rate must be a number >= 0 or an optax "
                     f"schedule, got {learning_rate=!r}")
  _mesh.check_axis_name(axis_name)
  for name, v in (("b1", b1), ("b2", b2)):
    if not is_number(v) or not 0 <= v < 1:
      raise ValueError(f"{name} must be a number in [0, 1), got {name}={v!r}")
  if not is_number(eps) or eps < 0:
    raise ValueError(f"eps must be a number >= 0, got {eps=!r}")
  if not is_number(weight_decay) or weight_decay < 0:
    raise ValueError(f"weight_decay must be a number >= 0, got "
                     f"{weight_decay=!r}")


def check_step(name: str, value, low: int = 1) -> int:
  """``value`` as an int, or ValueError naming ``name``."""
  if (isinstance(value, bool) or not isinstance(value, numbers.Integral)
      or value < low):
    raise ValueError(f"{name} must be an integer >= {low}, got "
                     f"{name}={value!r}")
  return int(value)


def check_per_device(leaves, axis_name: AxisName, who: str) -> None:
  """Raises TypeError for a gradient JAX already summed over the devices
  (plain ``jax.grad`` of replicated parameters inside ``shard_map``)."""
  if not _mesh.types_track_devices(axis_name):
    return
  axes = set(_mesh.axes(axis_name))
  if any(not axes <= _mesh.varying_axes(x) for x in leaves):
    raise TypeError(
        f"{who} takes each device's own gradient, but this one is the same "
        f"on every device of {axis_name!r} (jax.grad of replicated "
        "parameters inside shard_map sums it): use jaxcomp.make_train_step "
        "or jaxcomp.per_device_grad")


def leaf_facts(params) -> tuple[list[int], list[int]]:
  """``(nbytes, sizes)`` of the parameters' leaves."""
  leaves = jax.tree.leaves(params)
  return ([int(jnp.size(x)) * jnp.result_type(x).itemsize for x in leaves],
          [int(jnp.size(x)) for x in leaves])


def adam_direction(spec: AdamSpec, mu, nu, params):
  """``m / (sqrt(v) + eps) (+ weight_decay * params)`` per leaf (DeepSpeed's
  ``update``; no bias correction)."""
  d = [m / (jnp.sqrt(v) + jnp.float32(spec.eps)) for m, v in zip(mu, nu)]
  if spec.weight_decay:
    d = [x + jnp.float32(spec.weight_decay) * jnp.asarray(p).astype(
        jnp.float32) for x, p in zip(d, params)]
  return d


def _init(spec: AdamSpec, params) -> OneBitAdamState:
  _mesh.check_bound(spec.axis_name, "onebit_adam.init")
  nbytes, sizes = leaf_facts(params)
  zeros = jax.tree.map(lambda x: jnp.zeros(jnp.shape(x), jnp.float32), params)
  worker, server = _exchange.init_errors(sizes, spec.axis_name)
  return OneBitAdamState(
      count=jnp.zeros((), jnp.int32), mu=zeros, nu=zeros,
      worker_error=worker, server_error=server,
      stats=_exchange.init_stats(nbytes, sizes, spec.axis_name,
                                 (worker, server)))


def _update(spec: AdamSpec, updates, state: OneBitAdamState, params=None):
  if spec.weight_decay and params is None:
    raise ValueError("onebit_adam with weight_decay needs params: "
                     "tx.update(grads, state, params)")
  axis_name, b1, b2 = spec.axis_name, spec.b1, spec.b2
  _mesh.check_bound(axis_name, "onebit_adam.update")
  g_leaves, treedef = jax.tree.flatten(updates)
  check_per_device(g_leaves, axis_name, "onebit_adam")
  mu, nu = treedef.flatten_up_to(state.mu), treedef.flatten_up_to(state.nu)
  frozen = state.count >= spec.freeze_step

  def warmup(args):
    mu, nu, worker, server = args
    # The dense mean in the gradient's own dtype, as the engine's
    # all-reduce of the gradient before the optimizer runs.
    g = [lax.pmean(x, axis_name).astype(jnp.float32) for x in g_leaves]
    mu = [b1 * m + (1 - b1) * x for m, x in zip(mu, g)]
    nu = [b2 * v + (1 - b2) * x * x for v, x in zip(nu, g)]
    return mu, nu, worker, server

  def compressed(args):
    mu, nu, worker, server = args
    local = [b1 * m + (1 - b1) * x.astype(jnp.float32)
             for m, x in zip(mu, g_leaves)]
    means, worker, server = _exchange.compressed_allreduce(
        [x.reshape(-1) for x in local], worker, server, axis_name)
    return ([x.reshape(jnp.shape(m)) for x, m in zip(means, mu)], nu,
            list(worker), list(server))

  mu, nu, worker, server = _mesh.cond(
      frozen, compressed, warmup,
      (mu, nu, list(state.worker_error), list(state.server_error)))
  p_leaves = treedef.flatten_up_to(params) if spec.weight_decay else mu
  lr = spec.lr(state.count)
  new = [(-lr * d).astype(x.dtype) for d, x in zip(
      adam_direction(spec, mu, nu, p_leaves), g_leaves)]
  unflat = lambda xs: jax.tree.unflatten(treedef, xs)
  return unflat(new), OneBitAdamState(
      config=state.config,
      count=state.count + 1, mu=unflat(mu), nu=unflat(nu),
      worker_error=tuple(worker), server_error=tuple(server),
      stats=_exchange.count(state.stats, ~frozen, frozen))


def onebit_adam(learning_rate: float | Callable = 1e-3, *,
                axis_name: AxisName = "data", freeze_step: int,
                b1: float = 0.9, b2: float = 0.999, eps: float = 1e-8,
                weight_decay: float = 0.0, nonfinite: str = "skip"
                ) -> optax.GradientTransformation:
  """1-bit Adam: dense Adam for ``freeze_step`` steps, then the variance
  frozen and the momentum averaged by a 1-bit compressed all-reduce.

  An Optax transformation that runs its own exchange: give it each
  device's gradient inside ``jax.shard_map`` over ``axis_name`` (what
  :func:`jaxcomp.make_train_step` does), with no ``compressed_mean``
  before it. Per step ``t`` (from 0), every leaf, float32:

  * warm-up, ``t < freeze_step``: ``g = pmean(g_i)`` (a dense all-reduce),
    ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``;
  * after it: ``m_i = b1 m + (1 - b1) g_i`` from this device's own
    gradient, then ``m = C(m_i)``, the 1-bit average of the ``m_i`` with
    worker and server error compensation (DeepSpeed's
    ``compressed_allreduce``: scale ``||x||_2 / sqrt(N)`` times sign; see
    :mod:`jaxcomp.optimizers`); ``v`` stays as the warm-up left it;
  * the update ``-lr_t (m / (sqrt(v) + eps) + weight_decay * params)``,
    with no bias correction (DeepSpeed's ``OnebitAdam``).

  The momentum and variance are the same on every device (replicated by
  :func:`jaxcomp.init`); the worker error (the leaf's size rounded up to a
  multiple of ``p * lcm(p, 8)``) and the server error (``1 / p`` of that)
  are each device's own. The paper warns that resetting them (DeepSpeed
  does on every checkpoint load) hurts convergence when done often; here
  they are state like any other and an Orbax checkpoint restores them.
  Traffic by phase: :func:`jaxcomp.get_stats` (one 1-bit exchange
  sends about 1/32 of the dense all-reduce's bytes, plus 3 float32 scales
  per leaf).

  Args:
    learning_rate: a number, or an optax schedule of the step count.
    axis_name: the data-parallel mesh axis (or axes).
    freeze_step: warm-up steps of dense Adam, an integer >= 1 (the paper:
      15-25% of the run, long enough for the variance to settle).
    b1: the momentum's decay, in [0, 1).
    b2: the variance's decay, in [0, 1).
    eps: added to ``sqrt(v)``, >= 0.
    weight_decay: added to the update times the parameters, >= 0
      (``update`` then needs ``params``).
    nonfinite: what a NaN or Inf in any device's gradient does:
      ``"skip"`` (default) the step returns zero updates and leaves the
      whole state (errors, momentum, counters) as it was, on every device,
      but for one more ``stats.skipped_steps`` (``get_stats``'
      ``skipped_steps``), at the cost of one 4-byte all-reduce per step
      (not in the byte counts); ``"none"`` no check.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`OneBitAdamState`; its updates are in each gradient leaf's
    dtype.

  Raises:
    ValueError: at construction, for a bad argument (named in the
      message); in ``update``, weight decay without ``params``.
    TypeError: in ``update``, for a gradient already summed over the
      devices.
    NameError: ``init``/``update`` outside ``shard_map`` over
      ``axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.onebit_adam(1e-2, axis_name="data", freeze_step=2)
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
    Tang et al., 1-bit Adam: Communication Efficient Large-Scale Training
    with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>, ICML
    2021 (Algorithm 1); DeepSpeed, ``deepspeed/runtime/fp16/onebit/adam.py``
    and ``deepspeed/runtime/comm/nccl.py``.
  """
  check_adam_args(learning_rate, axis_name, b1, b2, eps, weight_decay)
  spec = AdamSpec(learning_rate=learning_rate, axis_name=axis_name,
                  freeze_step=check_step("freeze_step", freeze_step),
                  b1=float(b1), b2=float(b2), eps=float(eps),
                  weight_decay=float(weight_decay))
  return _exchange.transformation("onebit_adam", spec, _init, _update, axis_name,
                                 nonfinite)
