"""Zen-style sparse synchronisation for gradients that are sparse by nature.

Embedding tables (and some LLM layers) produce gradients whose nonzeros are a
small, data-dependent subset, often skewed (hot rows touched by every
device). Zen (Wang et al., OSDI 2025) hash-partitions the nonzero indices over
the devices so that every device owns an equal share of the reduction,
sends each partition to its owner with an all-to-all, lets the owner sum the
duplicates, and all-gathers the reduced nonzeros with their indices encoded as
a bitmap over the owner's partition. XLA needs static shapes, so here each
partition has a fixed capacity, and what does not fit is kept for the next
step instead of being lost.
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import wire
from jaxcomp._mesh import axis_size, varying_zeros
from jaxcomp.collectives.base import Collective, chunk_size, register
from jaxcomp.wire import axes_of, devices
from jaxcomp.compressors.base import num_selected
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import compact

# Odd 16-bit multipliers (Knuth's golden-ratio 40503 first); hash_seed picks
# one, and the first coprime with the table size from there is used.
_MULTIPLIERS = (40503, 52429, 36969, 36001, 61681, 43691, 26317,
                56599)


def hash_multiplier(m: int, hash_seed: int = 0) -> int:
  """The multiplier ``a`` of the index hash ``h(i) = a * i mod m``.

  ``a`` is an odd number below 2**16, coprime with ``m`` (so ``h`` is a
  permutation of ``[0, m)``), chosen by ``hash_seed``.
  """
  a = _MULTIPLIERS[hash_seed % len(_MULTIPLIERS)] + 2 * (
      hash_seed // len(_MULTIPLIERS))
  a = a % (1 << 16) | 1
  while math.gcd(a, m) != 1:
    a += 2
  return a % m if m > 1 else 0


def _shift16(t: jax.Array, mm: jax.Array) -> jax.Array:
  for _ in range(16):  # t * 2**16 mod m; t < m < 2**31, so 2t < 2**32
    t = (t * jnp.uint32(2)) % mm
  return t


def hash_index(i: jax.Array, a: int, m: int) -> jax.Array:
  """``(a * i) mod m`` in uint32 arithmetic, without 64-bit integers.

  Args:
    i: int32 or uint32 indices in ``[0, m)``, any shape.
    a: multiplier, ``0 <= a < 2**16``.
    m: modulus, ``1 <= m < 2**31``.

  Returns:
    int32 array of the shape of ``i``.

  Raises:
    ValueError: ``a`` or ``m`` out of range.
  """
  if not 0 <= a < (1 << 16) or not 1 <= m < (1 << 31):
    raise ValueError(f"need 0 <= a < 2**16 and 1 <= m < 2**31, got {a=}, {m=}")
  u = i.astype(jnp.uint32)
  mm = jnp.uint32(m)
  aa = jnp.uint32(a)
  hi = _shift16((aa * (u >> 16)) % mm, mm)  # aa * (u >> 16) < 2**31
  lo = (aa * (u & jnp.uint32(0xFFFF))) % mm
  return ((hi + lo) % mm).astype(jnp.int32)


def unhash_index(h: jax.Array, a: int, m: int) -> jax.Array:
  """The inverse of :func:`hash_index`: the index ``i`` with ``a * i mod m
  == h`` (``a`` coprime with ``m``), int32 of the shape of ``h``."""
  b = pow(a, -1, m) if m > 1 else 0
  mm = jnp.uint32(m)
  hi = _shift16(hash_index(h, b >> 16, m).astype(jnp.uint32), mm)
  lo = hash_index(h, b & 0xFFFF, m).astype(jnp.uint32)
  return ((hi + lo) % mm).astype(jnp.int32)


@register
@dataclasses.dataclass(frozen=True)
class Zen(Collective):
  """Hash-partitioned sparse all-reduce of the nonzeros (Zen).

  For a bucket of ``n`` elements on ``p`` devices, with ``c = ceil(n / p)``
  and ``m = p * c``:

  0. ``y = decode(encode(v))``: what the compressor lets through (with the
     identity compressor, the gradient itself, already sparse); ``local`` is
     ``y``, so the transform's error feedback keeps only the compressor's
     error. This collective's state, ``o`` (float32 ``(n,)``, varying), is
     what did not fit in an earlier step; ``s = y + o`` is to be sent.
  1. Hash: index ``i`` goes to position ``h(i) = a * i mod m`` (``a`` odd,
     coprime with ``m``, below 2**16: a permutation that spreads hot,
     neighbouring rows over the owners; ``hash_seed`` re-hashes), owned by
     device ``h(i) // c`` at offset ``h(i) % c``.
  2. All-to-all: the first ``K = min(n, p * cap)`` nonzeros of ``s``, in
     index order, are packed into ``p`` partitions of ``cap = ceil(
     capacity_factor * k / p)`` (value float32, offset int32) slots, with
     ``k = ceil(density * n)``; device ``j`` receives every device's
     partition ``j``. Nonzeros beyond a partition's capacity stay in ``o``.
  3. The owner scatter-adds what it received into its ``c``-element
     partition (duplicates summed in float32).
  4. All-gather: every owner sends a bitmap of its partition's nonzeros
     (``ceil(c / 32)`` uint32 words, :mod:`jaxcomp.kernels.bitpack`) and the
     values of the first ``cap2`` of them in offset order, ``cap2 =
     min(c, p * cap)`` (lossless) or ``ceil(gather_capacity_factor * k / p)``
     when given (fewer bytes where devices share nonzeros). Reduced values
     beyond ``cap2`` are added to the owner's ``o`` (as sums: the owner
     sends them again next step on behalf of everyone).
  5. Every device decodes all bitmaps: the mean ``sum / p``, invariant.

  Nothing is lost: over steps, ``p * sum_t mean_t == sum_i (sum_t y_i,t -
  o_i,T)`` (float32 rounding aside), whether or not error feedback is on.
  With enough capacity (``o`` stays zero), the mean equals ``lax.pmean`` of
  ``y`` up to summation order (exactly, for integer-valued gradients).

  Traffic per device: operands ``8 p cap`` bytes (all-to-all) plus ``4
  ceil(c / 32) + 4 cap2`` (all-gather); ring bytes ``8 (p - 1) cap + (p - 1)
  (4 ceil(c / 32) + 4 cap2)``, against ``(p - 1) 8 k`` for an all-gather of
  ``k`` (index, value) pairs and ``8 (p - 1) / p n`` for a dense ring
  all-reduce.

  Args:
    density: expected fraction of nonzeros in one device's bucket, in
      (0, 1].
    capacity_factor: all-to-all slots per partition relative to an even
      split, ``cap = ceil(capacity_factor * k / p)``; > 0.
    gather_capacity_factor: reduced nonzeros an owner all-gathers, relative
      to ``k / p``; None (default) for ``p * cap`` (never overflows); > 0.
    hash_seed: picks the hash multiplier (re-hashing), >= 0.

  Raises:
    ValueError: at construction, for parameters out of range; at trace
      time, for a bucket of 2**31 elements or more.

  References:
    Wang et al., Zen: Empowering Distributed Training with Sparsity-driven
    Data Synchronization <https://www.usenix.org/conference/osdi25/presentation/wang-zhuang>,
    OSDI 2025.
  """

  name: ClassVar[str] = "zen"
  reduce_scatter: ClassVar[bool] = False
  density: float = 0.01
  capacity_factor: float = 2.0
  gather_capacity_factor: float | None = None
  hash_seed: int = 0

  def __post_init__(self):
    for field in ("density", "capacity_factor", "gather_capacity_factor"):
      v = getattr(self, field)
      if v is None and field == "gather_capacity_factor":
        continue
      if isinstance(v, bool) or not isinstance(v, numbers.Real):
        raise TypeError(f"{field} must be a number, got {field}={v!r}")
    if not 0.0 < self.density <= 1.0:
      raise ValueError(f"density must be in (0, 1], got {self.density=}")
    if not (math.isfinite(self.capacity_factor) and self.capacity_factor > 0):
      raise ValueError(
          f"capacity_factor must be > 0, got {self.capacity_factor=}")
    if self.gather_capacity_factor is not None and not (
        math.isfinite(self.gather_capacity_factor) and self.gather_capacity_factor > 0):
      raise ValueError(f"gather_capacity_factor must be > 0, got "
                       f"{self.gather_capacity_factor=}")
    if (isinstance(self.hash_seed, bool)
        or not isinstance(self.hash_seed, numbers.Integral)
        or self.hash_seed < 0):
      raise ValueError(f"hash_seed must be an integer >= 0, got "
                       f"{self.hash_seed=!r}")

  def capacities(self, n: int, num_devices: int) -> tuple[int, int]:
    """``(cap, cap2)``: all-to-all slots per partition and all-gathered
    values per owner, for an ``n``-element bucket on ``num_devices``."""
    p = num_devices
    c = chunk_size(n, p)
    k = num_selected(self.density, n)
    cap = min(c, max(1, math.ceil(self.capacity_factor * k / p)))
    if self.gather_capacity_factor is None:
      cap2 = min(c, p * cap)
    else:
      cap2 = min(c, max(1, math.ceil(self.gather_capacity_factor * k / p)))
    return cap, cap2

  @property
  def topology(self) -> str:
    # The overflow is in units of this device's gradient: its mean is
    # what the mean update will still receive.
    return "average"

  def unsent(self, compressor, state):
    del compressor
    return (state,)

  def init_buffer(self, compressor, n, axis_name):
    del compressor
    return varying_zeros(n, axis_name)

  def exchange_buffer(self, compressor, x, key, axis_name, state=()):
    n = x.shape[0]
    p = axis_size(axis_name)
    c = chunk_size(n, p)
    m = p * c
    if m >= 1 << 31:
      raise ValueError(f"zen handles buckets of fewer than 2**31 elements, "
                       f"got {n=}; use smaller buckets")
    a = hash_multiplier(m, self.hash_seed)
    cap, cap2 = self.capacities(n, p)
    y = compressor.decode(compressor.encode(x, key), n, key)
    s = y + state

    # Phase 1: pack the first K nonzeros into p partitions of cap slots.
    num_cand = min(n, p * cap)
    idx, valid, _ = compact.select(s, lambda v: v != 0, num_cand)
    idx = jnp.where(valid, idx, n)
    safe_idx = jnp.where(valid, idx, 0)
    h = hash_index(safe_idx, a, m)
    owner = jnp.where(valid, h // c, p)
    onehot = (owner[:, None] == jnp.arange(p, dtype=jnp.int32)[None, :])
    onehot = onehot.astype(jnp.int32)
    rank = jnp.sum(jnp.cumsum(onehot, axis=0) * onehot,
                   axis=1) - 1
    keep = valid & (rank < cap)
    slot = jnp.where(keep, owner * cap + rank, p * cap)
    vals = s[safe_idx]
    send_vals = jnp.zeros((p * cap,), jnp.float32).at[slot].set(
        vals, mode="drop")
    send_pos = jnp.zeros((p * cap,), jnp.int32).at[slot].set(
        h % c, mode="drop")
    sent = jnp.zeros((n,), jnp.float32).at[jnp.where(keep, idx, n)].set(
        vals, mode="drop")
    recv_vals = lax.all_to_all(send_vals.reshape(p, cap), axis_name, 0, 0)
    recv_pos = lax.all_to_all(send_pos.reshape(p, cap), axis_name, 0, 0)

    # Owner: sum duplicates over its partition.
    part = jnp.zeros((c,), jnp.float32).at[recv_pos.reshape(-1)].add(
        recv_vals.reshape(-1))

    # Phase 2: bitmap + the first cap2 reduced values, in offset order.
    nz = part != 0
    off2, valid2 = compact.compact(compact.pack(part, lambda v: v != 0), cap2)
    keep2 = jnp.zeros((c,), jnp.bool_).at[jnp.where(valid2, off2, c)].set(
        True, mode="drop")
    bitmap = compact.pack(keep2, lambda v: v)
    out_vals = jnp.where(valid2, part[off2], 0.0)
    all_bitmaps = lax.all_gather(bitmap, axis_name, to="invarying")
    all_vals = lax.all_gather(out_vals, axis_name, to="invarying")
    # The j-th set bit of owner o is its j-th value, at position o * c + off;
    # compacted from the gathered bitmaps themselves.
    off, got = jax.vmap(lambda w: compact.compact(w, cap2))(all_bitmaps)
    where = unhash_index(
        jnp.where(got, jnp.arange(p, dtype=jnp.int32)[:, None] * c + off, 0),
        a, m)
    mean = jnp.zeros((n,), jnp.float32).at[
        jnp.where(got, where, n).reshape(-1)].add(
            all_vals.reshape(-1), mode="drop") / p

    # What did not travel stays with this device.
    unsent2 = jnp.where(nz & ~keep2, part, 0.0)
    me = lax.axis_index(axis_name)
    mine = unhash_index(me * c + jnp.arange(c, dtype=jnp.int32), a, m)
    owner_back = jnp.zeros((n,), jnp.float32).at[mine].add(unsent2,
                                                           mode="drop")
    new_state = s - sent + owner_back
    return mean, y, new_state

  def buffer_transfers(self, compressor, n, sizes, dtype=jnp.float32):
    """An all-to-all of ``p cap`` values (float32, whatever the gradient's
    dtype) and offsets (int32), operands ``8 p cap`` bytes; an all-gather of
    the bitmap (``4 ceil(c / 32)``) and ``cap2`` values (``4 cap2``)."""
    del compressor, dtype
    axis, p = axes_of(sizes), devices(sizes)
    cap, cap2 = self.capacities(n, p)
    words = bitpack.packed_words(chunk_size(n, p), 1)
    return (wire.transfers("all-to-all", (4 * p * cap, 4 * p * cap), axis,
                           sizes)
            + wire.transfers("all-gather", (4 * words, 4 * cap2), axis, sizes))
