"""Selection by threshold and compaction into a fixed capacity: the one
selection primitive of the sparse compressors.

XLA needs static shapes, so a selection whose size depends on the data
(every entry above a threshold, every nonzero) is returned as the first
``capacity`` selected positions in index order, with how many were
selected. Top-k's fast path, DGC, the threshold compressor and Zen's sparse
sync all select this way:

1. :func:`pack` evaluates a predicate over ``x`` and packs it 32 per uint32
   word (one pass over ``x``; the partial last row is packed apart, so ``x``
   is never padded or copied);
2. :func:`count` is the number of set bits (popcounts of ``n / 32`` words);
3. :func:`compact` returns the positions of the first ``capacity`` set bits
   in increasing order, touching only the ``n / 32`` words and the
   ``capacity`` outputs: a prefix sum of the words' popcounts, each non-empty
   word's number scattered at its first output slot and carried forward by a
   running maximum, and a select-the-r-th-set-bit inside the word.

Prefix sums and running maxima come in two forms of the same values, picked
per backend (:func:`log_depth_scans`) or by the caller: log-depth scans of
whole-array operations (``lax.associative_scan``) on CPU, where XLA lowers
``jnp.cumsum`` / ``lax.cummax`` to a cascade of reduce-windows (2.5x slower
over top-k's 58,000 mask words on this project's 2-core CPU), and XLA's own
cumulative reductions elsewhere (XLA:GPU turns them into scan kernels; a
log-depth scan is some 30 levels of slices, pads and adds there), which is
what top-k's fast path ran when it was measured on an H100.

Bit ``j`` of word ``i`` is element ``32 i + j`` (the layout of
:mod:`jaxcomp.kernels.bitpack`). Pure ``jnp``; no sort over ``n``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

ROW = 32  # bits per word


def popcount(w: jax.Array) -> jax.Array:
  """int32 set bits of each uint32 word."""
  return jax.lax.population_count(w).astype(jnp.int32)


def pack(x: jax.Array, pred) -> jax.Array:
  """``pred`` of ``x`` packed 32 per uint32 word.

  Args:
    x: a flat ``(n,)`` array.
    pred: elementwise ``pred(block) -> bool`` of a block of ``x``'s values.

  Returns:
    uint32 ``(ceil(n / 32),)``; the bits past ``n`` are 0.
  """
  n = x.shape[0]
  m = n // ROW * ROW
  shifts = jnp.arange(ROW, dtype=jnp.uint32)

  def words(block2d):
    return jnp.sum(pred(block2d).astype(jnp.uint32) << shifts[None, :],
                   axis=1, dtype=jnp.uint32)

  parts = []
  if m:
    parts.append(words(x[:m].reshape(-1, ROW)))
  if n > m:
    live = jnp.arange(ROW) < n - m
    tail = jnp.pad(x[m:], (0, m + ROW - n))
    parts.append(words(tail.reshape(1, ROW)) & jnp.sum(
        live.astype(jnp.uint32) << shifts, dtype=jnp.uint32))
  if not parts:
    return jnp.zeros((0,), jnp.uint32)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


# Backends on which prefix sums and running maxima are log-depth scans.
LOG_DEPTH_SCAN_BACKENDS = ("cpu",)


def log_depth_scans() -> bool:
  """Whether :func:`cumsum` and :func:`cummax` take the log-depth form on
  the default backend (CPU), rather than XLA's cumulative reductions."""
  return jax.default_backend() in LOG_DEPTH_SCAN_BACKENDS


def cumsum(c: jax.Array, *, log_depth: bool | None = None) -> jax.Array:
  """Inclusive prefix sum of a 1-D int32 array: ``jnp.cumsum``'s values.

  Args:
    c: int32 ``(m,)``.
    log_depth: as a log-depth scan of whole-array adds
      (``lax.associative_scan``: XLA:CPU lowers ``jnp.cumsum`` to a cascade
      of reduce-windows, 2.5x slower over top-k's 58,000 mask words, 0.55
      ms against 0.21 ms on this project's 2-core CPU), or ``jnp.cumsum``
      itself; None: :func:`log_depth_scans`.

  Returns:
    int32 ``(m,)``, the same values either way.
  """
  if log_depth is None:
    log_depth = log_depth_scans()
  return jax.lax.associative_scan(jnp.add, c) if log_depth else jnp.cumsum(c)


def cummax(c: jax.Array, *, log_depth: bool | None = None) -> jax.Array:
  """Running maximum of a 1-D array: ``lax.cummax``'s values.

  Args:
    c: ``(m,)``.
    log_depth: as a log-depth scan (on XLA:CPU 0.18 ms against 0.45 ms over
      34,000 slots), or ``lax.cummax`` itself; None: :func:`log_depth_scans`.

  Returns:
    ``(m,)`` in ``c``'s dtype, the same values either way.
  """
  if log_depth is None:
    log_depth = log_depth_scans()
  if log_depth:
    return jax.lax.associative_scan(jnp.maximum, c)
  return jax.lax.cummax(c)


def count(words: jax.Array) -> jax.Array:
  """int32 number of set bits in ``words``."""
  return jnp.sum(popcount(words))


def select_bit(w: jax.Array, r: jax.Array) -> jax.Array:
  """int32 position of the ``r``-th (0-based) set bit of each uint32 ``w``."""
  pos = jnp.zeros(w.shape, jnp.uint32)
  r = r.astype(jnp.int32)
  for width in (16, 8, 4, 2, 1):
    low = popcount((w >> pos) & jnp.uint32((1 << width) - 1))
    go = r >= low
    r = jnp.where(go, r - low, r)
    pos = jnp.where(go, pos + jnp.uint32(width), pos)
  return pos.astype(jnp.int32)


def compact(words: jax.Array, capacity: int, *,
            log_depth: bool | None = None):
  """The positions of the first ``capacity`` set bits of ``words``, in
  increasing order.

  Args:
    words: uint32 ``(w,)`` bit masks (:func:`pack`).
    capacity: output slots, a Python integer >= 0.
    log_depth: the form of the prefix sum and running maximum
      (:func:`cumsum`); None: :func:`log_depth_scans`.

  Returns:
    ``(indices, valid)``: int32 ``(capacity,)`` positions (0 in the slots
    past the number of set bits) and bool ``(capacity,)``, which slots hold
    a position.
  """
  if capacity == 0 or words.shape[0] == 0:
    return (jnp.zeros((capacity,), jnp.int32),
            jnp.zeros((capacity,), jnp.bool_))
  counts = popcount(words)
  incl = cumsum(counts, log_depth=log_depth)
  excl = incl - counts
  # Slot j belongs to the last word whose first slot is <= j: write each
  # non-empty word's number at its first slot, then a running maximum.
  first = jnp.where(counts > 0, excl, capacity)
  start = jnp.zeros((capacity,), jnp.int32).at[first].set(
      jnp.arange(words.shape[0], dtype=jnp.int32), mode="drop")
  row = cummax(start, log_depth=log_depth)
  j = jnp.arange(capacity, dtype=jnp.int32)
  bit = select_bit(words[row], j - excl[row])
  valid = j < incl[-1]
  return jnp.where(valid, row * ROW + bit, 0), valid


def select(x: jax.Array, pred, capacity: int):
  """:func:`pack` then :func:`compact`: the first ``capacity`` positions
  where ``pred(x)`` holds, in index order, and how many hold.

  Returns:
    ``(indices int32 (capacity,), valid bool (capacity,), total int32)``.
  """
  words = pack(x, pred)
  idx, valid = compact(words, capacity)
  return idx, valid, count(words)
