"""Chunked top-k: SparseLoCo's compressor.

A tensor, viewed as ``(rows, cols)`` (a vector as one row; more axes folded
into ``cols``), is cut into ``h x w`` chunks as DeMo's DCT top-k cuts it
(:func:`jaxcomp.compressors.dct.chunks_of`: ``h`` and ``w`` the largest
divisors of ``rows`` and ``cols`` not above ``chunk``), and each chunk sends
its ``k`` entries of largest magnitude. An entry's index is its position
within its chunk, so it needs ``ceil(log2(h * w))`` bits (12 for the
4096-element chunks of SparseLoCo's ``chunk=64``) and travels packed at that
width (:func:`jaxcomp.kernels.bitpack.pack_codes`). The values travel as
``value_bits``-bit codes of SparseLoCo's quantizer, or as they are.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _parts
from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import register
from jaxcomp.compressors.dct import Chunks, chunks_of
from jaxcomp.compressors.sparse import SparsePayload
from jaxcomp.kernels import bitpack

VALUE_BITS = (2, 4, 8)


def chunk_k(chunk_elements: int, topk: int, chunk: int) -> int:
  """Entries sent from a chunk of ``chunk_elements``: ``topk`` scaled to the
  chunk's share of a full ``chunk x chunk`` one, rounded half to even (as
  the reference's Python ``round``), in ``[1, chunk_elements]``."""
  return max(1, min(chunk_elements, round(chunk_elements * topk / chunk ** 2)))


def index_bits(chunk_elements: int) -> int:
  """Bits of an index within a chunk of ``chunk_elements``:
  ``ceil(log2(chunk_elements))``, at least 1."""
  return max(1, (chunk_elements - 1).bit_length())


def quantize_statistical(values: jax.Array, bits: int,
                         range_sigmas: float) -> dict:
  """SparseLoCo's quantizer of the sent values (the reference's
  ``TopKCompressor._quantize``): centred on their mean, ``2**bits`` bins of
  width ``range_sigmas * std / 2**bits`` around it (values beyond fall in
  the end bins), each bin decoded as the mean of the values that fell in
  it.

  Args:
    values: ``(m,)`` floats, the values of one tensor.
    bits: bits per code (``2**bits`` bins).
    range_sigmas: the bins span this many standard deviations (the
      reference's ``quantization_range``, 6).

  Returns:
    ``{"codes": uint32 (ceil(m bits / 32),), "lookup": float32 (2**bits,),
    "shift": float32 (1,)}``: a code's value is ``lookup[code] + shift``.
  """
  bins = 2 ** bits
  v = values.astype(jnp.float32)
  m = v.shape[0]
  shift = jnp.mean(v)
  c = v - shift
  std = (jnp.sqrt(jnp.sum(c * c)) / jnp.float32(math.sqrt(m - 1)) if m > 1
         else jnp.float32(0.0))
  scale = jnp.float32(range_sigmas) * std / jnp.float32(bins)
  scale = jnp.where((scale == 0) | ~jnp.isfinite(scale), jnp.float32(1.0),
                    scale)
  q = jnp.clip(jnp.round(c / scale + jnp.float32(bins // 2)), 0, bins - 1
               ).astype(jnp.int32)
  sums = jnp.zeros((bins,), jnp.float32).at[q].add(c)
  counts = jnp.zeros((bins,), jnp.float32).at[q].add(1.0)
  lookup = jnp.where(counts > 0, sums / jnp.where(counts > 0, counts, 1.0), 0.0)
  return {"codes": bitpack.pack_codes(q, bits), "lookup": lookup,
          "shift": shift.reshape(1)}


def dequantize_statistical(payload: dict, bits: int, m: int) -> jax.Array:
  """float32 ``(m,)`` values of :func:`quantize_statistical`'s codes."""
  q = bitpack.unpack_codes(payload["codes"], bits, m)
  return payload["lookup"][q] + payload["shift"][0]


@register
@dataclasses.dataclass(frozen=True)
class ChunkedTopK(SparsePayload):
  """The ``k`` largest-magnitude entries of each chunk of a tensor, with
  indices within the chunk: SparseLoCo's compressor.

  Chunks as DeMo's (:func:`jaxcomp.compressors.dct.chunks_of`; a full one
  is ``chunk x chunk``, 4096 elements at ``chunk=64``); each sends ``k =
  round(h * w * topk / chunk**2)`` entries (``topk`` for a full chunk, at
  least 1), as the reference scales it. Bound to a tensor's shape by
  :meth:`for_shapes` (:func:`jaxcomp.compressed_mean` binds each bucket of
  its default ``bucketing="auto"``, layer-wise for it); unbound, an ``n``-element buffer
  is viewed as rows of ``chunk`` (zero-padded), so that its chunks are
  consecutive runs of ``chunk**2`` elements (how the performance model
  prices it).

  Payload, for ``K`` entries in all (``k`` per chunk) and chunks of ``h *
  w`` elements:

  * ``indices``: uint32, the index within the chunk packed at ``b =
    ceil(log2(h * w))`` bits, ``4 ceil(K b / 32)`` bytes (12 bits at 64 x
    64);
  * with ``value_bits``: ``codes`` uint32 (``4 ceil(K value_bits / 32)``
    bytes), ``lookup`` float32 ``(2**value_bits,)`` and ``shift`` float32
    ``(1,)``: SparseLoCo's statistical quantizer
    (:func:`quantize_statistical`), one per tensor. Without: ``values`` in
    the gradient's dtype (``4 K`` bytes for float32).

  At the defaults (64 of each 4096, 2-bit values) a full chunk costs 64 x
  (12 + 2) bits = 112 bytes against 16,384 dense: 146x fewer operand bytes,
  plus 20 bytes per tensor. Biased and not linear: all-gathered (``(p -
  1)`` times the payload on a ring); ``collective="sender_mean"`` averages
  each coordinate over the devices that sent it, as the reference does
  (``scatter_reduce(..., "mean", include_self=False)``), the default
  ``"allgather"`` over all devices, as the paper writes it. Residual error
  feedback keeps what was not sent, quantization error included.

  Args:
    topk: entries sent per full ``chunk x chunk`` chunk, an integer >= 1
      (SparseLoCo: 64 of 4096, 1.56%).
    chunk: the chunk size target per axis, an integer >= 1.
    value_bits: 2, 4 or 8 to send the values as codes of the statistical
      quantizer (SparseLoCo: 2), or None to send them as they are.
    range_sigmas: the quantizer's range in standard deviations of the sent
      values (the reference's ``quantization_range``, 6), > 0.
    shape: the tensor's shape (set by :meth:`for_shapes`), or None.

  Raises:
    ValueError: ``topk`` or ``chunk`` not an integer >= 1, ``value_bits``
      not in (2, 4, 8) or None, or ``range_sigmas`` not a finite number >
      0, at construction; a bucket of more than one tensor in
      :meth:`for_shapes` (use ``bucketing="layerwise"``).

  References:
    Sarfi, Thérien, Lidin & Belilovsky, Communication Efficient LLM
    Pre-training with SparseLoCo <https://arxiv.org/abs/2508.15706>, 2025;
    reference implementation https://github.com/tplr-ai/SparseLoCo
    (``src/tplr/sparseloco.py``: ``ChunkingTransform``,
    ``TopKCompressor``).
  """

  name: ClassVar[str] = "chunked_topk"
  biased: ClassVar[bool] = True
  per_tensor: ClassVar[bool] = True
  topk: int = 64
  chunk: int = 64
  value_bits: int | None = 2
  range_sigmas: float = 6.0
  shape: tuple | None = None

  def __post_init__(self):
    for f in ("topk", "chunk"):
      _hparams.check_positive_int(getattr(self, f), f)
    if self.value_bits is not None and self.value_bits not in VALUE_BITS:
      raise ValueError(f"value_bits must be one of {VALUE_BITS} or None, got "
                       f"value_bits={self.value_bits!r}")
    r = self.range_sigmas
    if (isinstance(r, bool) or not isinstance(r, numbers.Real)
        or not math.isfinite(r) or r <= 0):
      raise ValueError(f"range_sigmas must be a finite number > 0, got "
                       f"range_sigmas={r!r}")

  def for_shapes(self, shapes):
    if len(shapes) != 1:
      raise ValueError(
          f"chunked_topk selects within one tensor's chunks; this bucket has "
          f"{len(shapes)} tensors: use bucketing='layerwise'")
    return dataclasses.replace(self, shape=tuple(shapes[0]))

  def chunks(self, n: int) -> Chunks:
    """The chunking of an ``n``-element buffer (the bound tensor's, or the
    flat view's), with ``k`` entries sent per chunk.

    Raises:
      ValueError: a bound compressor given another number of elements.
    """
    if self.shape is not None:
      if math.prod(self.shape) != n:
        raise ValueError(f"chunked_topk bound to shape {self.shape} got "
                         f"{n=} elements")
      c = chunks_of(self.shape, self.chunk, 1)
    else:
      rows = -(-int(n) // (self.chunk * self.chunk)) * self.chunk
      c = chunks_of((rows, self.chunk), self.chunk, 1)
    return c._replace(k=chunk_k(c.h * c.w, self.topk, self.chunk))

  def capacity(self, n: int) -> int:
    """Entries sent for an ``n``-element buffer: ``k`` per chunk."""
    c = self.chunks(n)
    return c.count * c.k

  def index_bits(self, n: int) -> int:
    """Bits of one packed index: ``ceil(log2(h * w))`` of the chunks."""
    c = self.chunks(n)
    return index_bits(c.h * c.w)

  def _tiles(self, x, c: Chunks):
    size = c.rows * c.cols
    x = x if size == x.shape[0] else jnp.pad(x, (0, size - x.shape[0]))
    x = x.reshape(c.rows // c.h, c.h, c.cols // c.w, c.w)
    return x.transpose(0, 2, 1, 3).reshape(c.count, c.h * c.w)

  def encode(self, x, key):
    del key
    c = self.chunks(x.shape[0])
    tiles = self._tiles(x, c)
    _, idx = lax.top_k(jnp.abs(tiles), c.k)  # ties: the lower index
    values = jnp.take_along_axis(tiles, idx, axis=-1).reshape(-1)
    payload = {"indices": bitpack.pack_codes(idx.reshape(-1),
                                             index_bits(c.h * c.w))}
    if self.value_bits is None:
      return {**payload, "values": values}
    return {**payload, **quantize_statistical(values, self.value_bits,
                                              self.range_sigmas)}

  def _entries(self, payload, n: int):
    """``(flat indices int32 (K,), values float32 (K,))`` of one payload:
    each index within its chunk mapped to its place in the tensor."""
    c = self.chunks(n)
    m = c.count * c.k
    local = bitpack.unpack_codes(payload["indices"], index_bits(c.h * c.w),
                                 m).astype(jnp.int32).reshape(c.count, c.k)
    if self.value_bits is None:
      values = payload["values"].astype(jnp.float32)
    else:
      values = dequantize_statistical(payload, self.value_bits, m)
    tile = jnp.arange(c.count, dtype=jnp.int32)[:, None]
    tr, tc = tile // (c.cols // c.w), tile % (c.cols // c.w)
    r, s = local // c.w, local % c.w
    flat = (tr * c.h + r) * c.cols + tc * c.w + s
    # Entries in the padding of an unbound buffer land past n: dropped.
    return flat.reshape(-1), values

  def _stacked_entries(self, payloads, n: int):
    return jax.vmap(lambda p: self._entries(p, n))(payloads)

  def decode_parts(self, payload, part_sizes, key):
    del key
    idx, values = self._entries(payload, sum(part_sizes))
    return _parts.SparseParts(idx, values, part_sizes)

  def decode_sum_parts(self, payloads, part_sizes, key):
    del key
    idx, values = self._stacked_entries(payloads, sum(part_sizes))
    return _parts.SparseParts(idx, values, part_sizes).dense()

  def decode_sender_mean(self, payloads, n, key):
    """Each coordinate's sum over the devices that sent it divided by how
    many did (0 where none did): the reference's ``scatter_reduce(...,
    reduce="mean", include_self=False)``. Every slot is a sent entry (a
    value quantized to 0 still counts)."""
    del key
    idx, values = self._stacked_entries(payloads, n)
    idx = jnp.where(idx < n, idx, n).reshape(-1)
    total = jnp.zeros((n,), jnp.float32).at[idx].add(values.reshape(-1),
                                                     mode="drop")
    count = jnp.zeros((n,), jnp.float32).at[idx].add(1.0, mode="drop")
    return total / jnp.maximum(count, 1.0)

  def payload_arrays(self, n: int, dtype=jnp.float32) -> tuple[int, ...]:
    """By formula, in the payload's tree order (tested against tracing
    ``encode``): ``codes``, ``indices``, ``lookup``, ``shift`` with
    ``value_bits``; ``indices``, ``values`` (in ``dtype``) without."""
    c = self.chunks(int(n))
    m = c.count * c.k
    indices = 4 * bitpack.code_words(m, index_bits(c.h * c.w))
    if self.value_bits is None:
      return (indices, m * jnp.dtype(dtype).itemsize)
    return (4 * bitpack.code_words(m, self.value_bits), indices,
            4 * 2 ** self.value_bits, 4)

  def payload_bytes(self, n: int) -> int:
    return sum(self.payload_arrays(n))
