"""The Pallas (Mosaic GPU) kernels of top-k's Pallas path
(:func:`jaxcomp.kernels.topk.topk`): the mask pass and the radix select.

The mask pass is one kernel that writes ``key > t`` and ``key == t``
together, 32 per uint32 word (:func:`threshold_masks`; so ``x`` is read once
on every call, and the ties branch needs nothing more); the exact branch is
a radix select over the 31-bit key (:func:`radix_select`), ``radix_bits``
bits per pass, each pass one kernel that counts, per block, the elements
with ``key >= base + c * 2**shift`` for all digits ``c`` (7 passes of 5
bits, :func:`count_ge`), then one more mask kernel. The compaction runs in
XLA on ``n / 32`` words and the candidates (Mosaic GPU stores go through
shared memory and TMA copies of whole tiles, which do not fit a
data-dependent scatter). ``key``: :func:`jaxcomp.kernels.topk.abs_key`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _launch

ROW = _launch.ROW
_NUM_CANDIDATES = 32  # one SMEM/TMA transfer of 128 bytes holds 32 int32.
# The 32 int32 thresholds: the same block (all of them) at every grid step,
# copied to shared memory, where the kernels read them as scalars.
_THRESHOLDS_SPEC = pl.BlockSpec((_NUM_CANDIDATES,), lambda i: (0,))


def _count_kernel(thresholds_ref, x_ref, counts_ref, *, block: _launch.Block):
  """``counts_ref[c] = #(key >= thresholds_ref[c])`` over one block of rows.

  ``thresholds_ref``: int32 (32,) thresholds (shared memory on GPU);
  ``x_ref``: (R, 32) float32; ``counts_ref``: int32 (32,), this block's
  counts.
  """
  x = block.tile(x_ref[...])
  key = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
  for c in range(_NUM_CANDIDATES):
    per_row = jnp.sum((key >= thresholds_ref[c]).astype(jnp.int32), axis=1)
    counts_ref[c] = jnp.sum(per_row)


def _mask_kernel(thresholds_ref, x_ref, gt_ref, eq_ref, *, block_rows: int,
                 block: _launch.Block):
  """Packs ``key > t`` and ``key == t`` (``t = thresholds_ref[0]``) 32 per
  uint32 word: ``gt_ref``, ``eq_ref`` uint32 ``(R,)``, one word per row."""
  x = block.tile(x_ref[...])
  key = jax.lax.bitcast_convert_type(x, jnp.int32) & jnp.int32(0x7FFFFFFF)
  t = thresholds_ref[0]
  col = block.column_iota(block_rows)
  gt_ref[...] = jnp.sum((key > t).astype(jnp.uint32) << col, axis=1,
                        dtype=jnp.uint32)
  eq_ref[...] = jnp.sum((key == t).astype(jnp.uint32) << col, axis=1,
                        dtype=jnp.uint32)


def count_ge(rows: jax.Array, thresholds: jax.Array, *, block_rows: int,
             interpret: bool | _launch.Interpret = False) -> jax.Array:
  """Counts of ``key >= thresholds[c]`` over ``rows`` (Pallas), int32 (32,)."""
  grid = -(-rows.shape[0] // block_rows)
  counts, = _launch.blocked_call(
      _count_kernel,
      grid=grid,
      inputs=[("thresholds_ref", _THRESHOLDS_SPEC),
              ("x_ref", _launch.rows_spec(block_rows))],
      outputs=[("counts_ref",
                _launch.out_struct((grid * _NUM_CANDIDATES,), jnp.int32, rows),
                pl.BlockSpec((_NUM_CANDIDATES,), lambda i: (i,)))],
      interpret=interpret,
      name="jaxcomp_topk_count",
  )(thresholds, rows)
  return jnp.sum(counts.reshape(grid, _NUM_CANDIDATES), axis=0)


def threshold_masks(rows: jax.Array, t: jax.Array, *, block_rows: int,
                    interpret: bool | _launch.Interpret = False
                    ) -> tuple[jax.Array, jax.Array]:
  """Packed masks ``key > t`` and ``key == t`` (Pallas), uint32 per row."""
  grid = -(-rows.shape[0] // block_rows)
  tvec = jnp.broadcast_to(t.astype(jnp.int32), (_NUM_CANDIDATES,))
  word = _launch.out_struct((rows.shape[0],), jnp.uint32, rows)
  return _launch.blocked_call(
      functools.partial(_mask_kernel, block_rows=block_rows),
      grid=grid,
      inputs=[("thresholds_ref", _THRESHOLDS_SPEC),
              ("x_ref", _launch.rows_spec(block_rows))],
      outputs=[("gt_ref", word, _launch.vector_spec(block_rows)),
               ("eq_ref", word, _launch.vector_spec(block_rows))],
      interpret=interpret,
      name="jaxcomp_topk_mask",
  )(tvec, rows)


def radix_passes(radix_bits: int) -> list[tuple[int, int]]:
  """``(shift, bits)`` of each counting pass over the 31-bit key."""
  if not 1 <= radix_bits <= 5:
    raise ValueError(f"{radix_bits=} must be in [1, 5] (32 counters a pass)")
  passes, hi = [], 31
  while hi > 0:
    b = min(radix_bits, hi)
    passes.append((hi - b, b))
    hi -= b
  return passes


def radix_select(rows: jax.Array, k: int, *, block_rows: int, radix_bits: int,
                 interpret: bool | _launch.Interpret = False) -> jax.Array:
  """Exact ``k``-th largest key of ``rows`` (int32 scalar), by counting."""
  passes = radix_passes(radix_bits)
  shifts = jnp.array([p[0] for p in passes], jnp.int32)
  widths = jnp.array([p[1] for p in passes], jnp.int32)
  digits = jnp.arange(_NUM_CANDIDATES, dtype=jnp.int32)

  def one_pass(i, base):
    # A loop, not a Python unroll: the kernel is lowered and compiled once.
    shift = shifts[i]
    live = digits < (jnp.int32(1) << widths[i])
    # Digit 0 is ``base`` itself (count >= k by induction); unused slots get
    # the largest key, and are masked out below.
    t = jnp.where(live, base + (digits << shift), jnp.int32(0x7FFFFFFF))
    counts = count_ge(rows, t, block_rows=block_rows, interpret=interpret)
    digit = jnp.sum(((counts >= k) & live)[1:]).astype(jnp.int32)
    return base + (digit << shift)

  return jax.lax.fori_loop(0, len(passes), one_pass,
                           _launch.zero_like(rows, jnp.int32))


def live_words(words: jax.Array, n: int) -> jax.Array:
  """Mask words of padded rows cut to ``ceil(n / 32)``, the bits past ``n``
  cleared (padding reads as key 0, which a threshold of 0 would pass)."""
  m = -(-n // ROW)
  words = words[:m]
  if n % ROW:
    last = jnp.uint32((1 << (n % ROW)) - 1)
    words = words.at[m - 1].set(words[m - 1] & last)
  return words
