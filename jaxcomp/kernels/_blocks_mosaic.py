"""The quantizers' Pallas (Mosaic GPU) kernel: its layout, what every
kernel body shares, and its launch.

The Pallas kernels (Mosaic GPU) read ``x`` once (one-pass kernel). ``x`` is
viewed as ``(num_groups, group)``, one bucket (QSGD) / block (int8, fp8)
per row, ``block_groups = max(64, block_rows // group_rows)`` rows per grid
step (``group_rows = group // 32``); the kernel loads the block's
``group_rows`` column slices of 32 as ``(block_groups, 32)`` WGMMA tiles,
reduces each group in registers (sum of squares, or ``max|x|``), computes
the norm / scale and the multiplier, and quantizes and packs from the same
registers. It writes:

* the packed words as ``(num_groups, group_rows * bits)`` uint32, row-major
  in wire order (word ``k * bits + w`` of a group is word ``w`` of its
  ``k``-th row of 32), so the flat word stream is a free reshape. QSGD's
  2-bit codes in buckets of 32 (2 words and 1 norm a bucket, rows narrower
  than TMA's 16 bytes) take 4 buckets a row: 8 words and 4 norms, in wire
  order too. Where sign packing groups fewer than 4 rows (lengths that are
  not multiples of 1024, to avoid a padding copy) the kernel writes its
  words word-major, ``(group_rows, num_groups)``, and XLA transposes them
  (``n / 32`` words);
* one float32 per group (per bucket): the QSGD norm, the int8 / fp8 scale,
  or the sign path's sum of ``|x|`` (XLA adds those ``n / group`` values
  for the scale).

One pass applies where ``group_rows`` divides ``block_rows`` and the input
blocks fit :data:`MAX_INPUT_BLOCK_BYTES` of shared memory: with the default
256 rows, buckets / blocks of 32, 64, 128, 256 and 512 elements given a
seed (or nearest rounding), up to 256 given a uniform array. Other
multiples of 32 (96, 160, 640, 1024, ...) fall back to XLA: norms / scales
reduced first (a second read of ``x``) and handed to the kernel as one
multiplier per 32-element row (a vector written and read back); those
match the reference bit for bit. Sizes that are not multiples of 32 need
``implementation='xla'``.

Copies that remain: a float32 input whose length is a whole number of
(8, group) tiles is read in place (the last block may be partial: TMA
zero-fills on load); any other input (bf16 / f16, or a ragged length) is
converted and zero-padded once before the kernel, and the outputs are cut
to length after it. 8-bit codes are packed 4 per uint32 by the kernel
(``bits=8`` little-endian, i.e. the same bytes as the int8 / uint8 array)
and bit-cast back for free. ``tests/test_kernel_structure.py`` counts these
from the CUDA export (:mod:`jaxcomp.hlo.kernel_structure`).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, cast

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _blocks
from . import _launch
from . import dither
from ._blocks import check_seed
from ._blocks import check_size
from ._blocks import inverse_scales
from ._blocks import uniform_f32

ROW = _launch.ROW


# ----------------------------------------------------------------------------
# The one-pass kernel: layout.
# ----------------------------------------------------------------------------


# Shared memory the one-pass kernel's (block_groups, group) float32 input
# blocks may take: x, plus the uniform numbers when they come as an array.
# 64 groups (one WGMMA row tile) of 16 rows of x are 128 KiB; Mosaic GPU
# allows 227 KiB per block, outputs included.
MAX_INPUT_BLOCK_BYTES = 128 * 1024


@dataclasses.dataclass(frozen=True)
class Plan:
  """How one quantize call lays ``x`` out for the kernel.

  ``group`` elements (``group_rows = group // 32`` rows of 32) form one row
  of the kernel's 2-D view of ``x`` (``(num_groups, group)``), and a block
  is ``block_groups`` such rows. ``in_kernel`` says whether the kernel
  reduces each group itself (one-pass) or is handed one multiplier per
  32-element row computed by XLA first (``group == 32`` then).
  ``buckets_per_row`` > 1: a row holds that many buckets of 32, one per
  column slice, each with its own statistic (written ``(B,
  buckets_per_row)``): QSGD's 2-bit codes in buckets of 32, whose 2 words
  and 1 norm per bucket are rows narrower than TMA's 16 bytes, are written
  4 buckets a row (8 words, 4 norms) in wire order.
  """
  group: int
  block_groups: int
  in_kernel: bool
  buckets_per_row: int = 1

  @property
  def group_rows(self) -> int:
    return self.group // ROW


def one_pass_plan(group: int, block_rows: int, inputs: int = 1, bits: int = 8
                  ) -> Plan | None:
  """The one-pass layout for buckets / blocks of ``group`` elements, or None
  where it does not apply: ``group`` not a multiple of 32, ``group // 32``
  not dividing ``block_rows``, or ``inputs`` float32 blocks (x, and the
  uniform array if one is passed) over ``MAX_INPUT_BLOCK_BYTES``. A block
  holds ``max(64, block_rows // group_rows)`` groups (at least one WGMMA row
  tile: with 256 rows, buckets of 256 and 512 make blocks of 512 and 1024
  rows). With the default 256 rows, buckets of 32 to 512 elements (a power
  of two times 32) run in one pass given a seed, 32 to 256 given a uniform
  array; 96, 160, ... (row counts that do not divide 256) and over 512 do
  not."""
  if group % ROW:
    return None
  per_row = buckets_per_row(group, bits)
  group *= per_row
  g = group // ROW
  if block_rows % g:
    return None
  block_groups = max(64, block_rows // g)
  if inputs * block_groups * group * 4 > MAX_INPUT_BLOCK_BYTES:
    return None
  return Plan(group=group, block_groups=block_groups, in_kernel=True,
              buckets_per_row=per_row)


def buckets_per_row(group: int, bits: int) -> int:
  """Buckets a row of the kernel's view holds: 4 where one bucket's words
  (``group / 32 * bits``) would make rows narrower than TMA's 16 bytes
  (QSGD's 2-bit codes in buckets of 32; 4 norms make 16 bytes), else 1."""
  return 4 if group == ROW and bits < 4 else 1


def to_groups(v: jax.Array, plan: Plan):
  """Flat ``v`` as ``(num_groups, group)`` rows and the grid.

  A float32, bfloat16 or float16 ``v`` whose size is a multiple of ``8 *
  group`` (whole (8, group) TMA tiles) is only reshaped (free), in its own
  dtype: the kernel converts it to float32 in registers, so 16-bit inputs
  are read in place, half the bytes of a float32 copy. The last block may
  be partial (TMA zero-fills the rows past the end on load and drops them on
  store; :func:`_launch.blocked_call` does the same in interpret mode). Any
  other input is converted to float32 and zero-padded once to whole tiles.
  """
  n = v.size
  flat = v.reshape(-1)
  tile = 8 * plan.group
  if flat.dtype in _blocks.IN_PLACE and n % tile == 0 and n:
    padded = n
  else:
    padded = max(tile, -(-n // tile) * tile)
    flat = jnp.pad(flat.astype(jnp.float32), (0, padded - n))
  num_groups = padded // plan.group
  return (flat.reshape(num_groups, plan.group),
          -(-num_groups // plan.block_groups))


def groups_spec(plan: Plan, dtype=jnp.float32):
  """BlockSpec of ``block_groups`` rows of a ``(num_groups, group)`` array
  (float32, or 16-bit floats read in place); column slices of 32 of it are
  ``(block_groups, 32)`` tiles: 128 bytes wide for float32, 64 for 16-bit
  types (the swizzle follows the tile's width in bytes)."""
  return _launch.tiled_spec((plan.block_groups, plan.group), lambda i: (i, 0),
                            dtype)


SEED_WORDS = 32  # the seed travels as 128 bytes: TMA copies whole warpgroups

# ----------------------------------------------------------------------------
# The one-pass kernel: what every kernel body shares.
# ----------------------------------------------------------------------------
#
# A block holds ``B = block_groups`` groups (buckets / blocks) of
# ``group_rows`` rows of 32; the kernel loads the ``group_rows`` column
# slices of 32 as ``(B, 32)`` tiles, reduces each group in registers where
# it computes its statistic, encodes each slice and packs it into ``bits``
# words per row of 32, and writes ``words_ref (B, group_rows * bits)
# uint32``: word ``k * bits + w`` of a group is word ``w`` of its ``k``-th
# row of 32, so the flat output is the wire's word stream (``(group_rows *
# bits, B)`` instead where ``word_major``). Refs the kernels may take
# besides: ``mult_ref (B,) f32``, the multiplier of each row's bucket /
# block computed by XLA (the fallback of groups that do not fit one pass,
# ``group == 32``); ``u_ref (B, group) f32`` the uniform rounding numbers,
# or ``seed_ref (32,) uint32`` (words 0, 1: the hash seed, the numbers
# computed from each element's flat index).


def columns(x_ref, plan: Plan, block: _launch.Block) -> list[jax.Array]:
  """The block's ``group_rows`` column slices of 32, float32 ``(B, 32)``."""
  return [block.tile(x_ref[:, pl.ds(ROW * k, ROW)]).astype(jnp.float32)
          for k in range(plan.group_rows)]


def row_total(values: list[jax.Array], reduce, combine) -> jax.Array:
  """``reduce`` along the rows of each value (one at least), combined: one
  per group."""
  total = reduce(values[0], axis=1)
  for v in values[1:]:
    total = combine(total, reduce(v, axis=1))
  return total


def per_row(m: jax.Array, plan: Plan) -> jax.Array:
  """A per-group ``(B,)`` value broadcast along the rows, ``(B, 32)``."""
  return jax.lax.broadcast_in_dim(m, (plan.block_groups, ROW), (0,))


def rounding(plan: Plan, block: _launch.Block, col, u_ref, seed_ref):
  """A function of the slice number ``k`` giving the ``(B, 32)`` float32
  rounding numbers of that slice: read from ``u_ref``, or hashed from
  ``seed_ref``'s seed and each element's flat index (block offset + group *
  group size + 32 k + column); None where neither ref is given."""
  if u_ref is not None:
    return lambda k: block.tile(u_ref[:, pl.ds(ROW * k, ROW)])
  if seed_ref is None:
    return None
  b = plan.block_groups
  seed = (seed_ref[0], seed_ref[1])
  index = block.index.astype(jnp.uint32)
  # Flat index of element (group r, row k, column c) of this block.
  base = ((index * jnp.uint32(b) + block.row_iota(b))
          * jnp.uint32(plan.group) + col)
  return lambda k: dither.to_unit(dither.hash_bits(seed, base + jnp.uint32(ROW * k)))


def word_shift(col, bits: int):
  """Bit offset of each element's code in its word."""
  return (col % jnp.uint32(32 // bits)) * jnp.uint32(bits)


def store_words(codes, k: int, words_ref, *, col, shift, bits: int,
                word_major: bool, block: _launch.Block) -> None:
  """Packs the uint32 codes of slice ``k`` into its ``bits`` words per row
  (disjoint bit ranges: the sum is the bitwise or)."""
  shifted = codes << shift
  per_word = 32 // bits
  for w in range(bits):
    part = shifted if bits == 1 else jnp.where(
        col // jnp.uint32(per_word) == jnp.uint32(w), shifted, jnp.uint32(0))
    word = jnp.sum(part, axis=1, dtype=jnp.uint32)
    if word_major:
      words_ref[k * bits + w] = word
    else:
      block.store(words_ref.at[:, k * bits + w], word)


def block_multiplier(xs, plan, block, scales_ref, mult_ref, top: float):
  """int8 / fp8: each block's scale ``max|x| / top`` (written to
  ``scales_ref``) and its multiplier, or the rows' multipliers from
  ``mult_ref``, broadcast along the rows."""
  if mult_ref is None:
    scales = row_total([jnp.abs(v) for v in xs], jnp.max,
                       jnp.maximum) / jnp.float32(top)
    scales_ref[...] = scales
    m = inverse_scales(scales)
  else:
    m = block.row(mult_ref[...])
  return per_row(m, plan)


# ----------------------------------------------------------------------------
# The one-pass kernel: launch.
# ----------------------------------------------------------------------------


def pack_call(body, x_groups, row_mult, u_groups, seed, *, name: str,
              stat_name: str, bits: int, plan: Plan, grid: int, interpret,
              **statics):
  """Runs a quantizer's kernel ``body``: ``(words uint32 (num_groups *
  group_rows * bits,), statistic float32 (num_groups,) or None)``,
  ``words`` already in wire order.

  Args:
    body: the kernel body, taking its refs by name (``x_ref``,
      ``words_ref``, the statistic's ``stat_name`` and those of
      ``mult_ref``, ``u_ref`` and ``seed_ref`` that are given), ``plan``,
      ``word_major``, ``block`` and ``statics``.
    x_groups: ``(num_groups, group)`` (:func:`to_groups`).
    row_mult: float32 per-row multipliers (the fallback), or None.
    u_groups: float32 ``(num_groups, group)`` rounding numbers, or None.
    seed: uint32 ``(2,)``, or None.
    name: the launch's name (``jaxcomp_<op>_pack``).
    stat_name: the ref name of the per-group statistic the body writes.
    bits, plan, grid, interpret: the codes' width, the layout, the number of
      blocks and interpret mode.
    **statics: the body's own static arguments.
  """
  operands = [x_groups]
  # pl.BlockSpecs, and plgpu.BlockSpecs where TMA tiles the block.
  inputs: list[tuple[str, Any]] = [
      ("x_ref", groups_spec(plan, x_groups.dtype))]
  if row_mult is not None:
    operands.append(row_mult)
    inputs.append(("mult_ref", _launch.vector_spec(plan.block_groups)))
  if u_groups is not None:
    operands.append(u_groups)
    inputs.append(("u_ref", groups_spec(plan)))
  elif seed is not None:
    operands.append(jnp.pad(check_seed(seed), (0, SEED_WORDS - 2)))
    inputs.append(("seed_ref", pl.BlockSpec((SEED_WORDS,), lambda i: (0,))))
  num_groups = x_groups.shape[0]
  width = plan.group_rows * bits
  # TMA needs rows of whole 16 bytes: narrower groups of words are written
  # word-major, (width, num_groups), and transposed by XLA afterwards.
  word_major = width % 4 != 0
  if word_major:
    outputs = [("words_ref", _launch.out_struct((width, num_groups), jnp.uint32, x_groups),
                pl.BlockSpec((width, plan.block_groups), lambda i: (0, i)))]
  else:
    outputs = [("words_ref", _launch.out_struct((num_groups, width), jnp.uint32, x_groups),
                pl.BlockSpec((plan.block_groups, width), lambda i: (i, 0)))]
  if plan.in_kernel and plan.buckets_per_row > 1:
    per_row_ = plan.buckets_per_row
    outputs.append((stat_name,
                    _launch.out_struct((num_groups, per_row_), jnp.float32, x_groups),
                    pl.BlockSpec((plan.block_groups, per_row_), lambda i: (i, 0))))
  elif plan.in_kernel:
    outputs.append((stat_name,
                    _launch.out_struct((num_groups,), jnp.float32, x_groups),
                    _launch.vector_spec(plan.block_groups)))
  out = _launch.blocked_call(
      functools.partial(body, plan=plan, word_major=word_major, **statics),
      grid=grid,
      inputs=inputs,
      outputs=outputs,
      interpret=interpret,
      name=name,
  )(*operands)
  # Row-major (group, word) is the wire's order.
  words = (out[0].T if word_major else out[0]).reshape(-1)
  return words, (out[1].reshape(-1) if plan.in_kernel else None)


def row_values(per_group: jax.Array, group: int, num_rows: int) -> jax.Array:
  """A per-group value repeated for each of its rows of 32, ``(num_rows,)``."""
  return _launch.pad_rows_vector(jnp.repeat(per_group, group // ROW), num_rows)


def check_pallas_group(name: str, group: int) -> None:
  """Raises ValueError unless ``group`` is a multiple of 32."""
  if group % ROW:
    raise ValueError(
        f"the Pallas path needs bucket/block sizes that are multiples of {ROW},"
        f" got {name}={group}; use implementation='xla'")


def quantize(x, body, *, name: str, stat_name: str, size_name: str,
             statistic, multiplier, bits, group, uniform, seed, config,
             interpret, **statics):
  """The QSGD / int8 / fp8 Pallas path: one pass where :func:`one_pass_plan`
  applies, else XLA reduces the groups first and the kernel gets one
  multiplier per row.

  Args:
    x: float array of ``n`` elements.
    body, name, stat_name, statics: the kernel, as :func:`pack_call` takes
      them.
    size_name: ``"bucket_size"`` or ``"block_size"``, for errors.
    statistic: float32 ``(n,)`` -> the per-group statistic the kernel
      computes itself on one pass (norms, scales), for the fallback.
    multiplier: the per-group statistic -> the per-group multiplier.
    bits, group: the codes' width and the bucket / block size.
    uniform, seed: the rounding numbers (at most one), or neither.
    config, interpret: as the wrappers take them.

  Returns:
    ``(words, per-group statistic)``, ``words`` of ``ceil(n / group) *
    group * bits / 32`` (or more) uint32 words.

  Raises:
    ValueError: bad ``config.block_rows``, a group size that is not a
      positive multiple of 32, both ``uniform`` and ``seed``.
  """
  _launch.check_block_rows(config.block_rows)
  check_size(size_name, group)
  check_pallas_group(size_name, group)
  if uniform is not None and seed is not None:
    raise ValueError("pass either uniform random values or a seed, not both")
  plan = one_pass_plan(group, config.block_rows,
                       inputs=1 if uniform is None else 2, bits=bits)
  u_source = None if uniform is None else uniform_f32(uniform)
  launch: dict[str, Any] = dict(name=name, stat_name=stat_name, bits=bits,
                interpret=interpret, **statics)
  if plan is not None:
    xg, grid = to_groups(x, plan)
    ug = None if u_source is None else to_groups(u_source, plan)[0]
    words, stat = pack_call(body, xg, None, ug, seed, plan=plan, grid=grid,
                            **launch)
    return words, cast(jax.Array, stat)  # one-pass plans reduce in the kernel
  # Fallback: XLA's per-group statistic, handed over as per-row multipliers.
  stat = statistic(x.reshape(-1).astype(jnp.float32))
  plan = Plan(group=ROW, block_groups=config.block_rows, in_kernel=False)
  xg, grid = to_groups(x, plan)
  ug = None if u_source is None else to_groups(u_source, plan)[0]
  row_mult = row_values(multiplier(stat), group, xg.shape[0])
  words, _ = pack_call(body, xg, row_mult, ug, seed, plan=plan, grid=grid,
                       **launch)
  return words, stat
