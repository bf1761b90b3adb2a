"""Top-k of chunked DCT coefficients: DeMo's compressor.

A tensor, viewed as ``(rows, cols)`` (a vector as one row; more axes folded
into ``cols``), is cut into ``h x w`` chunks, ``h`` and ``w`` the largest
divisors of ``rows`` and ``cols`` not above ``chunk``; each chunk is DCT-II
transformed (2-D, orthonormal) and keeps its ``topk`` largest coefficients
by magnitude. The payload is those coefficients (float32) and their indices
within the chunk (int32).
"""

from __future__ import annotations

import dataclasses
import math
from typing import ClassVar, NamedTuple

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, register


def smaller_split(n: int, close_to: int) -> int:
  """The largest divisor of ``n`` not above ``close_to`` (``n`` itself when
  ``n <= close_to``): the DCT chunk of an axis of ``n`` (DeMo's
  ``_get_smaller_split``)."""
  if n <= close_to:
    return n
  return max(d for d in range(1, close_to + 1) if n % d == 0)


def dct_matrix(n: int) -> jax.Array:
  """Orthonormal DCT-II basis: ``x @ m`` is the DCT of the rows of ``x``
  (``m.T`` inverts it)."""
  return jax.scipy.fft.dct(jnp.eye(n, dtype=jnp.float32), type=2,
                           norm="ortho", axis=-1)


class Chunks(NamedTuple):
  """How one tensor is cut into DCT chunks (static)."""

  rows: int  # the tensor viewed as (rows, cols) (1-D: one row)
  cols: int
  h: int  # chunk size along rows and cols
  w: int
  k: int  # coefficients kept per chunk

  @property
  def count(self) -> int:
    """Chunks in the tensor."""
    return (self.rows // self.h) * (self.cols // self.w)


def chunks_of(shape, chunk: int, topk: int) -> Chunks:
  """The chunking of a tensor of ``shape``."""
  if len(shape) <= 1:
    rows, cols = 1, (shape[0] if shape else 1)
    h = 1
  else:
    rows, cols = shape[0], math.prod(shape[1:])
    h = smaller_split(rows, chunk)
  w = smaller_split(cols, chunk)
  return Chunks(rows, cols, h, w, max(1, min(topk, h * w)))


def dct_encode(x, c: Chunks):
  """``x`` (``c.rows * c.cols`` elements) as per-chunk DCT coefficients,
  ``(c.count, h * w)``."""
  x = x.reshape(c.rows // c.h, c.h, c.cols // c.w, c.w)
  y = jnp.einsum("ihjw,hb,wd->ijbd", x, dct_matrix(c.h), dct_matrix(c.w))
  return y.reshape(-1, c.h * c.w)


def dct_decode(coef, c: Chunks):
  """The inverse of :func:`dct_encode`, flat: ``(c.rows * c.cols,)``."""
  y = coef.reshape(c.rows // c.h, c.cols // c.w, c.h, c.w)
  x = jnp.einsum("ijbd,hb,wd->ihjw", y, dct_matrix(c.h), dct_matrix(c.w))
  return x.reshape(-1)


@register
@dataclasses.dataclass(frozen=True)
class DCTTopK(Compressor):
  """The ``topk`` largest DCT-II coefficients of each chunk of a tensor.

  Bound to a tensor's shape (:meth:`for_shapes`, which
  :func:`jaxcomp.compressed_mean` calls per bucket, one tensor per bucket),
  it chunks the tensor as DeMo does; unbound (a flat buffer of ``n``
  elements, as the performance model prices it), the buffer is viewed as
  ``ceil(n / chunk**2) * chunk`` rows of ``chunk`` (zero-padded).

  Payload: ``values`` float32 and ``indices`` int32, each ``(chunks, k)``
  with ``k = min(topk, h * w)``: ``8 k`` bytes per chunk (a 64 x 64 float32
  chunk is 16,384 bytes, 64x fewer at the defaults). Biased, not linear:
  all-gathered; the ``"sender_mean"`` collective averages each coefficient
  over the devices that sent it (DeMo's mean), the all-gather over all.

  Args:
    topk: coefficients kept per chunk, >= 1.
    chunk: the chunk size target per axis, >= 1.
    shape: the tensor's shape (set by :meth:`for_shapes`), or None.

  Raises:
    ValueError: ``topk`` or ``chunk`` not an integer >= 1, at construction;
      a bucket of more than one tensor, in :meth:`for_shapes` (leave
      ``bucketing="layerwise"``, which ``compressed_mean`` requires).

  References:
    Peng, Quesnelle & Kingma, DeMo: Decoupled Momentum Optimization
    <https://arxiv.org/abs/2411.19870>, 2024; reference implementation
    https://github.com/bloc97/DeMo (``demo.py``; defaults from its OLMo
    configurations: top-k 32, chunk 64).
  """

  name: ClassVar[str] = "dct_topk"
  biased: ClassVar[bool] = True
  per_tensor: ClassVar[bool] = True
  topk: int = 32
  chunk: int = 64
  shape: tuple | None = None

  def __post_init__(self):
    for f in ("topk", "chunk"):
      _hparams.check_positive_int(getattr(self, f), f)

  def for_shapes(self, shapes):
    if len(shapes) != 1:
      raise ValueError(
          f"dct_topk transforms one tensor at a time; this bucket has "
          f"{len(shapes)}: use bucketing='layerwise'")
    return dataclasses.replace(self, shape=tuple(shapes[0]))

  def chunks(self, n: int) -> Chunks:
    """The chunking of an ``n``-element buffer (the bound tensor's, or the
    flat view's)."""
    if self.shape is not None:
      if math.prod(self.shape) != n:
        raise ValueError(f"dct_topk bound to shape {self.shape} got {n=} "
                         "elements")
      return chunks_of(self.shape, self.chunk, self.topk)
    rows = -(-int(n) // (self.chunk * self.chunk)) * self.chunk
    return chunks_of((rows, self.chunk), self.chunk, self.topk)

  def _coefficients(self, x):
    x = x.astype(jnp.float32)
    n = x.shape[0]
    c = self.chunks(n)
    size = c.rows * c.cols
    x = x if size == n else jnp.pad(x, (0, size - n))
    return dct_encode(x, c), c

  def encode(self, x, key):
    del key
    coef, c = self._coefficients(x)
    _, idx = lax.top_k(jnp.abs(coef), c.k)
    idx = idx.astype(jnp.int32)
    return {"values": jnp.take_along_axis(coef, idx, axis=-1),
            "indices": idx}

  def _from_coefficients(self, coef, c: Chunks, n: int):
    return dct_decode(coef, c)[:n]

  def decode(self, payload, n, key):
    del key
    c = self.chunks(n)
    rows = jnp.arange(c.count)[:, None]
    coef = jnp.zeros((c.count, c.h * c.w), jnp.float32).at[
        rows, payload["indices"]].set(payload["values"])
    return self._from_coefficients(coef, c, n)

  def _summed(self, payloads, n):
    c = self.chunks(n)
    rows = jnp.arange(c.count)[:, None]
    # zeros, not zeros_like: the sum is the same on every device.
    total = jnp.zeros((c.count, c.h * c.w), jnp.float32).at[
        rows[None], payloads["indices"]].add(payloads["values"])
    return total, rows, c

  def decode_sum(self, payloads, n, key):
    del key
    total, _, c = self._summed(payloads, n)
    return self._from_coefficients(total, c, n)

  def decode_sender_mean(self, payloads, n, key):
    """Each coefficient averaged over the devices that sent it (0 where
    none did), then the inverse DCT: DeMo's mean."""
    del key
    total, rows, c = self._summed(payloads, n)
    count = jnp.zeros((c.count, c.h * c.w), jnp.float32).at[
        rows[None], payloads["indices"]].add(1.0)
    return self._from_coefficients(total / jnp.maximum(count, 1.0), c, n)

  def payload_arrays(self, n: int, dtype=jnp.float32) -> tuple[int, ...]:
    del dtype  # the coefficients travel in float32
    c = self.chunks(n)
    return (4 * c.count * c.k, 4 * c.count * c.k)

  def payload_bytes(self, n: int) -> int:
    return sum(self.payload_arrays(n))
