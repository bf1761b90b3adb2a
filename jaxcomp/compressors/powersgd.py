"""PowerSGD: rank-r power iteration with a warm-started Q, through psum."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _parts
from jaxcomp import wire
from jaxcomp._mesh import axis_size, to_varying
from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, register


class PowerSGDState(NamedTuple):
  """Per-bucket state of :class:`PowerSGD` (identical on every device)."""

  q: tuple  # per compressed matrix: float32 (cols, r), the warm-started Q


def tensor_matrix_shape(shape) -> tuple[int, int]:
  """The matrix ``(rows, cols)`` a tensor of ``shape`` is viewed as: its axes
  split in two at the point that makes the matrix most square (largest
  ``min(rows, cols)``; ties to the later split). A Dense kernel ``(in,
  out)`` stays as it is; a convolution kernel ``(h, w, in, out)`` becomes its
  im2col matrix ``(h·w·in, out)``; Flax's attention kernels ``(d, heads,
  head_dim)`` and ``(heads, head_dim, d)`` become ``(d, heads·head_dim)``
  and ``(heads·head_dim, d)``, the projections they are. Vectors and
  scalars: ``(1, size)``."""
  shape = tuple(int(d) for d in shape)
  if len(shape) < 2:
    return 1, math.prod(shape)
  best = (math.prod(shape[:1]), math.prod(shape[1:]))
  for k in range(2, len(shape)):
    rows, cols = math.prod(shape[:k]), math.prod(shape[k:])
    if min(rows, cols) >= min(best):
      best = (rows, cols)
  return best


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
  """Orthonormalize the columns of ``m`` (float32 ``(rows, r)``, returned in
  the same shape and dtype) by Gram-Schmidt with reorthogonalization.

  Column ``i`` has the earlier, already normalized columns projected out
  twice, then is divided by ``||col|| + epsilon`` (with ``epsilon == 0`` a
  zero column stays zero; ``epsilon`` as in PyTorch's ``powerSGD_hook``).
  One projection pass, as in that hook for rank <= 2, leaves
  ``|Q^T Q - I|`` near ``cond(m) * eps``, so that ``P P^T M`` is no
  projection when the power iteration's ``P`` is ill-conditioned; the
  second pass keeps it at float32 rounding while ``cond(m)`` is well below
  ``1/eps``, as Householder QR (the hook's choice above rank 2) does.
  Giraud, Langou, Rozloznik, The loss of orthogonality in the Gram-Schmidt
  orthogonalization process, Comput. Math. Appl. 50 (2005) ("twice is
  enough"). For full-rank ``m`` and ``epsilon == 0`` the result is numpy's
  ``qr`` ``Q`` with the signs making ``R``'s diagonal positive. One
  ``lax.fori_loop`` over the columns, so the compiled size does not grow
  with the rank.
  """
  r = m.shape[1]
  cols = jnp.arange(r)

  def body(i, m):
    c = lax.dynamic_index_in_dim(m, i, axis=1, keepdims=False)
    done = jnp.where(cols[None, :] < i, m, 0.0)  # columns < i, already normalized
    for _ in range(2):
      c = c - _mm(done, _mm(c, done))
    norm = jnp.sqrt(jnp.sum(c * c))
    if epsilon:
      c = c / (norm + jnp.float32(epsilon))
    else:
      c = jnp.where(norm > 0, c / jnp.where(norm > 0, norm, 1.0), 0.0)
    return lax.dynamic_update_index_in_dim(m, c, i, axis=1)

  return lax.fori_loop(0, r, body, m)


def _mm(a, b):
  return jnp.matmul(a, b, precision=lax.Precision.HIGHEST)


def _mt_mm(m: jax.Array, p: jax.Array) -> jax.Array:
  """``m.T @ p`` for a thin ``p`` (float32 ``(rows, r)``): ``(cols, r)``.

  On XLA:CPU the transposed product runs as a slow general GEMM; ``r``
  vector-matrix products ``p[:, i] @ m`` read ``m`` in its own layout, once
  each, and took the rank-4 step of ``benchmarks/transform_overhead.py``
  from 1.60x the dense step to 1.15x. Above rank 8, or on other backends,
  the single product."""
  if jax.default_backend() != "cpu" or p.shape[1] > 8:
    return _mm(m.T, p)
  return jnp.stack([_mm(p[:, i], m) for i in range(p.shape[1])], axis=1)


@register
@dataclasses.dataclass(frozen=True)
class PowerSGD(Compressor):
  """PowerSGD (Vogels et al. 2019): rank-``r`` approximation by one step of
  power iteration per training step, warm-started, summed by psum.

  ``view="tensor"`` (the default, PyTorch's ``powerSGD_hook``): each tensor
  of a bucket (the collective hands PowerSGD the tensors and their shapes)
  is its own matrix
  ``M``, its axes split where the matrix is most square
  (:func:`tensor_matrix_shape`): a Dense kernel ``(in, out)`` as it is, a
  convolution kernel ``(h, w, in, out)`` as its im2col matrix ``(h·w·in,
  out)`` (PyTorch's ``(out, in·h·w)`` up to transpose and row order), an
  attention kernel ``(d, heads, head_dim)`` as ``(d, heads·head_dim)``.
  Vectors and scalars go through the exact all-reduce.
  ``view="flat"`` views the whole flat bucket as one near-square matrix
  (:func:`matrix_shape`; PyTorch's ``batched_powerSGD_hook`` without the
  padding); it mixes rows of a tensor and loses its low-rank structure (on
  the Fashion-MNIST CNN after 480 steps, rank 4 was 5.50 points of accuracy
  behind dense with it and 0.63 per tensor; ``docs/convergence.md``).

  Per step, following PyTorch's ``powerSGD_hook``, for every matrix ``M`` of
  the bucket at once:

  1. orthogonalize the kept ``Q`` (``(cols, r)``; random normal on the
     first step, drawn from the key :func:`jaxcomp.compressed_mean` derives
     from its ``seed``, the same on every device);
  2. ``P = M Q``; one psum of all P's and the exact segments; orthogonalize
     each ``P`` (Gram-Schmidt);
  3. ``Q = M^T P``; one psum of all Q's, divided by ``p``;
  4. the mean is ``P Q^T`` (= ``P P^T mean_i(M_i)``); ``Q`` is kept.

  ``local`` (what error feedback subtracts) is that mean approximation, as in
  PyTorch's hook: each device's residual is ``M_i - P Q^T``. PowerSGD is
  biased, so :func:`jaxcomp.compressed_mean` adds that residual feedback by
  default. With ``rank >= min(rows, cols)`` the result is the exact mean (up
  to float32 rounding). The rank is capped at ``min(rows, cols)``.

  Before step ``start_iter`` (the transform's step count, skipped steps
  included) the bucket goes through a plain float32 psum (an exact mean). Matrices with ``rows * cols / ((rows + cols) * r) <
  min_compression_rate`` always do (PyTorch's rule).

  ``rank`` may be scheduled (``optax.inject_hyperparams``) with ``max_rank``
  as the static capacity: columns of Q beyond the traced rank are zero, and
  P and Q keep ``max_rank`` columns on the wire.

  Payload per step: per compressed matrix P float32 ``(rows, r)`` and Q
  float32 ``(cols, r)``, ``4 * (rows + cols) * r`` bytes; per exact segment
  ``4 * size``; two psums per bucket.

  Args:
    rank: approximation rank r >= 1.
    start_iter: steps of exact all-reduce before compression starts, >= 0.
    min_compression_rate: compress only above this size ratio (> 0).
    orthogonalization_epsilon: added to the column norms in Gram-Schmidt
      (>= 0; PyTorch's default 0).
    max_rank: static rank capacity when ``rank`` is scheduled, or None.
    view: ``"tensor"`` (each tensor its own matrix) or ``"flat"`` (the
      bucket as one near-square matrix).

  Raises:
    ValueError: ``rank`` < 1, ``rank > max_rank``, a traced ``rank`` without
      ``max_rank``, ``start_iter`` < 0, ``min_compression_rate`` <= 0,
      ``orthogonalization_epsilon`` < 0, ``view`` not ``"tensor"`` or
      ``"flat"``.

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
  view: str = "tensor"

  def __post_init__(self):
    _hparams.check_number(self.rank, "rank", low=1, integer=True)
    if self.max_rank is not None:
      _hparams.check_number(self.max_rank, "max_rank", low=1, integer=True)
    _hparams.capacity(self.rank, self.max_rank, "rank", "max_rank")
    v = self.start_iter
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      raise TypeError(f"start_iter must be a Python integer, got start_iter={v!r}")
    if self.start_iter < 0:
      raise ValueError(f"start_iter must be >= 0, got {self.start_iter=}")
    _hparams.check_number(self.min_compression_rate, "min_compression_rate",
                          low=0.0, low_open=True)
    _hparams.check_number(self.orthogonalization_epsilon,
                          "orthogonalization_epsilon", low=0.0)
    if self.view not in ("tensor", "flat"):
      raise ValueError(f"view must be 'tensor' or 'flat', got {self.view!r}")

  def matrices(self, shapes) -> list[tuple[int, int, int, int]]:
    """How a bucket of tensors of ``shapes`` is viewed: ``(size, rows, cols,
    r)`` per matrix, one per tensor (:func:`tensor_matrix_shape`) or, with
    ``view="flat"``, one for the whole bucket (:func:`matrix_shape`).
    ``r`` is the rank capacity capped at ``min(rows, cols)``, or 0 where the
    matrix goes through the exact all-reduce (a vector, or below
    ``min_compression_rate``)."""
    cap = int(_hparams.capacity(self.rank, self.max_rank, "rank", "max_rank"))
    rate = float(_hparams.concrete(self.min_compression_rate) or 0.0)
    if self.view == "flat":
      n = sum(_parts.sizes(shapes))
      views = [(n, *matrix_shape(n))]
    else:
      views = [(math.prod(s), *tensor_matrix_shape(s)) for s in shapes]
    out = []
    for size, rows, cols in views:
      r = min(cap, rows, cols)
      if size == 0 or rows * cols / ((rows + cols) * r) < rate:
        r = 0
      out.append((size, rows, cols, r))
    return out

  def init_state(self, shapes, key, axis_name):
    del axis_name
    return PowerSGDState(q=tuple(
        jax.random.normal(jax.random.fold_in(key, i), (cols, r), jnp.float32)
        for i, (_, _, cols, r) in enumerate(self.matrices(shapes)) if r))

  def _live_columns(self, r: int) -> jax.Array:
    rank = _hparams.concrete(self.rank)
    if rank is not None:
      return jnp.ones((r,), jnp.float32)
    return (jnp.arange(r) < jnp.asarray(self.rank, jnp.int32)).astype(
        jnp.float32)

  def _compressed(self, xs, views, axis_name, qs):
    """One power-iteration step over every matrix: all P's (with the exact
    tensors) in one psum, all Q's in a second, as PyTorch's hook all-reduces
    a bucket's P's and Q's as one buffer each."""
    eps = float(_hparams.concrete(self.orthogonalization_epsilon) or 0.0)
    p_dev = jnp.float32(axis_size(axis_name))
    mats = [(x.reshape(rows, cols), r)
            for x, (_, rows, cols, r) in zip(xs, views) if r]
    exact = [x for x, (*_, r) in zip(xs, views) if not r]
    lives = [self._live_columns(r)[None, :] for _, r in mats]
    ps = [_mm(m, orthogonalize(q * live, eps))
          for (m, _), q, live in zip(mats, qs, lives)]
    summed = _psum_parts(exact + [p.reshape(-1) for p in ps], axis_name)
    exact_sum, ps = summed[:len(exact)], summed[len(exact):]
    ps = [orthogonalize(p.reshape(m.shape[0], r), eps)
          for p, (m, r) in zip(ps, mats)]
    q_parts = [_mt_mm(m, p) for (m, _), p in zip(mats, ps)]
    q_sum = _psum_parts([q.reshape(-1) for q in q_parts], axis_name)
    q_new = [q.reshape(qp.shape) / p_dev for q, qp in zip(q_sum, q_parts)]
    approx = iter(_mm(p, q.T).reshape(-1) for p, q in zip(ps, q_new))
    # Columns beyond a scheduled rank keep their previous (initially random)
    # values, so that they warm-start when the rank grows again.
    q_new = [jnp.where(live > 0, qn, q) for qn, q, live in zip(q_new, qs, lives)]
    exact_it = iter(zip(exact, exact_sum))
    means, locals_ = [], []
    for *_, r in views:
      if r:
        a = next(approx)
        means.append(a)
        # PyTorch's hook: the residual is M_i minus the mean's approximation.
        locals_.append(to_varying(a, axis_name))
      else:
        x, total = next(exact_it)
        means.append(total / p_dev)
        locals_.append(x)
    return tuple(means), tuple(locals_), tuple(q_new)

  def _exact(self, xs, axis_name, qs):
    # Plain all-reduce; this device contributed x itself (no residual).
    p_dev = jnp.float32(axis_size(axis_name))
    means = tuple(t / p_dev for t in _psum_parts(list(xs), axis_name))
    return means, tuple(xs), tuple(qs)

  def exchange(self, parts, shapes, *, key, step, axis_name, state):
    del key
    parts = tuple(x.astype(jnp.float32) for x in parts)
    xs = (_parts.concat(parts),) if self.view == "flat" else parts
    views = self.matrices(shapes)
    if not any(r for *_, r in views):
      mean, local, q = self._exact(xs, axis_name, state.q)
    elif self.start_iter == 0:
      mean, local, q = self._compressed(xs, views, axis_name, state.q)
    else:
      mean, local, q = lax.cond(
          step >= self.start_iter,
          lambda qs: self._compressed(xs, views, axis_name, qs),
          lambda qs: self._exact(xs, axis_name, qs), state.q)
    if self.view == "flat":
      sizes = _parts.sizes(shapes)
      mean, local = _parts.split(mean[0], sizes), _parts.split(local[0], sizes)
    return mean, local, PowerSGDState(q=q)

  def transfers(self, shapes, sizes, dtype=jnp.float32):
    """One all-reduce of the P's and the exact tensors, one of the Q's
    (float32 whatever the gradient's dtype); a bucket with no compressed
    matrix, one all-reduce of it."""
    del dtype
    views = self.matrices(shapes)
    axis = wire.axes_of(sizes)
    first = sum(rows * r if r else size for size, rows, _, r in views)
    second = sum(cols * r for _, _, cols, r in views)
    return wire.transfers("all-reduce",
                          [4 * first] + ([4 * second] if second else []),
                          axis, sizes)

  def buffer_transfers(self, n, sizes, dtype=jnp.float32):
    """:meth:`transfers` of the flat view of an ``n``-element buffer (one
    near-square matrix), whatever ``view`` is: the performance model knows
    no tensor shapes."""
    return dataclasses.replace(self, view="flat").transfers(((n,),), sizes,
                                                            dtype)

  def payload_bytes(self, n: int) -> int:
    """Bytes one device sends per step for one flat ``n``-element buffer in
    the flat view (what the performance model prices where it knows no
    tensor shapes): ``4 (rows + cols) r``, or ``4 n`` when not compressed.
    For a bucket of tensors, :meth:`transfers` counts each matrix."""
    flat = dataclasses.replace(self, view="flat")
    return 4 * sum((rows + cols) * r if r else size
                   for size, rows, cols, r in flat.matrices(((n,),)))


def _psum_parts(xs, axis_name):
  """``lax.psum`` of flat arrays as one concatenated buffer (one
  collective), cut back into the arrays."""
  if not xs:
    return []
  total = lax.psum(_parts.concat(tuple(xs)), axis_name)
  return list(_parts.split(total, [x.shape[0] for x in xs]))
