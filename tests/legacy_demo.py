"""jaxcomp.demo as it was before it became compressed_mean's four parts
(commit 2dc43c0, jaxcomp/lowcomm.py): the reference the new composition must
equal bit for bit (tests/test_lowcomm.py)."""
from __future__ import annotations

import math
import numbers
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp import _mesh
from jaxcomp import transform  # CompressionStats, traffic_stats
from jaxcomp import wire
from jaxcomp._mesh import AxisName


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

