"""PowerSGD: rank-r power iteration with a warm-started Q, through psum."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, register


class PowerSGDState(NamedTuple):
  """Per-bucket state of :class:`PowerSGD` (identical on every device)."""

  q: jax.Array  # shape=(cols, max_rank), float32, the warm-started Q
  count: jax.Array  # shape=(), int32, steps seen (for start_iter)


def matrix_shape(n: int) -> tuple[int, int]:
  """The near-square ``(rows, cols)`` a flat buffer of ``n`` elements is
  viewed as: ``rows`` is the largest divisor of ``n`` not above
  ``sqrt(n)``, ``cols = n // rows`` (no padding; a prime ``n`` gives
  ``(1, n)``, which ``min_compression_rate`` then sends uncompressed)."""
  r = math.isqrt(n)
  while n % r:
    r -= 1
  return r, n // r


def orthogonalize(m: jax.Array, epsilon: float = 0.0) -> jax.Array:
  """Gram-Schmidt on the columns of ``m`` (float32 ``(rows, r)``).

  As PyTorch's ``powerSGD_hook`` does it (modified Gram-Schmidt): column
  ``i`` is divided by ``||col|| + epsilon`` (with ``epsilon == 0`` a zero
  column stays zero) and then projected out of the later columns. One
  ``lax.fori_loop`` over the columns, so the compiled size does not grow
  with the rank.
  """
  r = m.shape[1]
  cols = jnp.arange(r)

  def body(i, m):
    c = lax.dynamic_index_in_dim(m, i, axis=1, keepdims=False)
    norm = jnp.sqrt(jnp.sum(c * c))
    if epsilon:
      c = c / (norm + jnp.float32(epsilon))
    else:
      c = jnp.where(norm > 0, c / jnp.where(norm > 0, norm, 1.0), 0.0)
    m = lax.dynamic_update_index_in_dim(m, c, i, axis=1)
    proj = jnp.where(cols > i, _mm(c, m), 0.0)
    return m - c[:, None] * proj[None, :]

  return lax.fori_loop(0, r, body, m)


def _mm(a, b):
  return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


@register
@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
  """PowerSGD (Vogels et al. 2019): rank-``r`` approximation by one step of
  power iteration per training step, warm-started, summed by psum.

  The flat bucket of ``n`` elements is viewed as a ``(rows, cols)`` matrix
  ``M`` (:func:`matrix_shape`, near-square: the transform hands compressors
  flat buffers, so this is PyTorch's ``batched_powerSGD_hook`` view without
  padding rather than its per-parameter ``(shape[0], -1)`` view; use
  ``bucketing="layerwise"`` and ``min_compress_size`` to keep vectors out).
  Per step, following PyTorch's ``powerSGD_hook``:

  1. orthogonalize the kept ``Q`` (``(cols, r)``; random normal from ``seed``
     on the first step, the same on every device);
  2. ``P = M Q``; ``P = psum(P)``; orthogonalize ``P`` (Gram-Schmidt);
  3. ``Q = M^T P``; ``Q = psum(Q) / p``;
  4. the mean is ``P Q^T`` (= ``P P^T mean_i(M_i)``); ``Q`` is kept.

  ``local`` (what error feedback subtracts) is that mean approximation, as in
  PyTorch's hook: each device's residual is ``M_i - P Q^T``. PowerSGD is
  biased, so :func:`jaxcomp.compressed_mean` adds that residual feedback by
  default. With ``rank >= min(rows, cols)`` the result is the exact mean (up
  to float32 rounding). The rank is capped at ``min(rows, cols)``.

  Before step ``start_iter`` the bucket goes through a plain float32 psum
  (an exact mean). Matrices with ``rows * cols / ((rows + cols) * r) <
  min_compression_rate`` always do (PyTorch's rule).

  ``rank`` may be scheduled (``optax.inject_hyperparams``) with ``max_rank``
  as the static capacity: columns of Q beyond the traced rank are zero, and
  P and Q keep ``max_rank`` columns on the wire.

  Payload per step (compressed): P float32 ``(rows, r)`` and Q float32
  ``(cols, r)``, two psums: ``4 * (rows + cols) * r`` bytes; uncompressed:
  ``4 * n``.

  Args:
    rank: approximation rank r >= 1.
    start_iter: steps of exact all-reduce before compression starts, >= 0.
    min_compression_rate: compress only above this size ratio (> 0).
    orthogonalization_epsilon: added to the column norms in Gram-Schmidt
      (>= 0; PyTorch's default 0).
    max_rank: static rank capacity when ``rank`` is scheduled, or None.
    seed: seed of the initial Q.

  Raises:
    ValueError: ``rank`` < 1, ``rank > max_rank``, a traced ``rank`` without
      ``max_rank``, ``start_iter`` < 0, ``min_compression_rate`` <= 0,
      ``orthogonalization_epsilon`` < 0.

  References:
    Vogels et al., PowerSGD: Practical Low-Rank Gradient Compression for
    Distributed Optimization <https://arxiv.org/abs/1905.13727>, 2019.
  """

  name: ClassVar[str] = "powersgd"
  biased: ClassVar[bool] = True
  own_exchange: ClassVar[bool] = True
  rank: int = 1
  start_iter: int = 0
  min_compression_rate: float = 2.0
  orthogonalization_epsilon: float = 0.0
  max_rank: int | None = None
  seed: int = 0

  def __post_init__(self):
    _hparams.check_number(self.rank, "rank", low=1, integer=True)
    if self.max_rank is not None:
      _hparams.check_number(self.max_rank, "max_rank", low=1, integer=True)
    _hparams.capacity(self.rank, self.max_rank, "rank", "max_rank")
    for field in ("start_iter", "seed"):
      v = getattr(self, field)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{field} must be a Python integer, got {field}={v!r}")
    if self.start_iter < 0:
      raise ValueError(f"start_iter must be >= 0, got {self.start_iter=}")
    _hparams.check_number(self.min_compression_rate, "min_compression_rate",
                          low=0.0, low_open=True)
    _hparams.check_number(self.orthogonalization_epsilon,
                          "orthogonalization_epsilon", low=0.0)

  def shape_and_rank(self, n: int) -> tuple[int, int, int]:
    """``(rows, cols, r)`` with the rank capacity capped at
    ``min(rows, cols)``."""
    rows, cols = matrix_shape(n)
    cap = int(_hparams.capacity(self.rank, self.max_rank, "rank", "max_rank"))
    return rows, cols, min(cap, rows, cols)

  def compresses(self, n: int) -> bool:
    """Whether an ``n``-element bucket is compressed (else: exact psum)."""
    rows, cols, r = self.shape_and_rank(n)
    return rows * cols / ((rows + cols) * r) >= float(
        _hparams.concrete(self.min_compression_rate) or 0.0)

  def init_state(self, n, axis_name):
    del axis_name
    rows, cols, r = self.shape_and_rank(n)
    del rows
    key = jax.random.fold_in(jax.random.key(self.seed), n)
    return PowerSGDState(q=jax.random.normal(key, (cols, r), jnp.float32),
                         count=jnp.zeros((), jnp.int32))

  def _live_columns(self, r: int) -> jax.Array:
    rank = _hparams.concrete(self.rank)
    if rank is not None:
      return jnp.ones((r,), jnp.float32)
    return (jnp.arange(r) < jnp.asarray(self.rank, jnp.int32)).astype(
        jnp.float32)

  def _compressed(self, x, axis_name, q):
    n = x.shape[0]
    rows, cols, r = self.shape_and_rank(n)
    eps = float(_hparams.concrete(self.orthogonalization_epsilon) or 0.0)
    p_dev = lax.axis_size(axis_name)
    m = x.reshape(rows, cols)
    live = self._live_columns(r)[None, :]
    q_new = orthogonalize(q * live, eps)
    p = lax.psum(_mm(m, q_new), axis_name)
    p = orthogonalize(p, eps)
    q_new = lax.psum(_mm(m.T, p), axis_name) / jnp.float32(p_dev)
    mean = _mm(p, q_new.T).reshape(-1)
    # Columns beyond a scheduled rank keep their previous (initially random)
    # values, so that they warm-start when the rank grows again.
    q_new = jnp.where(live > 0, q_new, q)
    # PyTorch's hook: the residual is M_i minus the mean's approximation.
    return mean, lax.pcast(mean, axis_name, to="varying"), q_new

  def _exact(self, x, axis_name, q):
    # Plain all-reduce; this device contributed x itself (no residual).
    return lax.psum(x, axis_name) / jnp.float32(lax.axis_size(axis_name)), x, q

  def exchange(self, x, key, axis_name, state):
    del key
    x = x.astype(jnp.float32)
    if not self.compresses(x.shape[0]):
      mean, local, q = self._exact(x, axis_name, state.q)
    elif self.start_iter == 0:
      mean, local, q = self._compressed(x, axis_name, state.q)
    else:
      mean, local, q = lax.cond(
          state.count >= self.start_iter,
          lambda q: self._compressed(x, axis_name, q),
          lambda q: self._exact(x, axis_name, q), state.q)
    return mean, local, PowerSGDState(q=q, count=state.count + 1)

  def payload_bytes(self, n: int) -> int:
    if not self.compresses(n):
      return 4 * n
    rows, cols, r = self.shape_and_rank(n)
    return 4 * (rows + cols) * r
