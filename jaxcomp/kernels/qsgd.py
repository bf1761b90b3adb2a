"""QSGD quantization: the Pallas kernel, its XLA reference and dispatch.

Wire format (Alistarh et al, QSGD: Communication-Efficient SGD via Gradient
Quantization and Encoding <https://arxiv.org/abs/1610.02132>, 2017). The
flat input is cut into buckets of ``bucket_size`` elements (the last one
zero-padded); ``norms[b]`` is the L2 norm of bucket ``b`` (float32). Each
element gets ``level = min(floor(|x| * m + u), levels)`` with the
per-bucket float32 multiplier ``m = levels / norm`` (``m = 0`` where
``norm == 0``), ``u`` uniform in [0, 1) given by the caller (an array, or a
seed hashed per element: :mod:`jaxcomp.kernels._blocks`), and the code
``sign << (bits - 1) | level`` with ``sign = x < 0``. ``bits =
qsgd_bits(levels)``, the smallest of 2, 4, 8, 16 that holds ``1 +
ceil(log2(levels + 1))`` bits. Codes are packed with
``pack_bits_reference(codes, bits)`` over the ``n`` real elements. Decode:
``(1 - 2 * sign) * norm * level / levels``. A bucket holding a NaN or an
infinity gets a non-finite norm on every path.

The kernel (:func:`qsgd_quantize`) reads ``x`` once: each bucket is one row
of its view of ``x``, its norm reduced in registers, the codes written in
wire order (2-bit codes in buckets of 32 four buckets a row). Its norms are
float32 sums in another order than XLA's ``group_reduce``, and a square
root from ``rsqrt`` plus one Heron step (Mosaic GPU lowers no ``sqrt``), so
they differ from :func:`qsgd_norms_reference` by a few ulp; the codes are
exactly :func:`qsgd_codes_reference` under the norms returned. Bucket
sizes that one pass does not fit take XLA's norms and match
:func:`qsgd_quantize_reference` bit for bit.
"""

from __future__ import annotations

import functools
import math
from typing import Any, cast
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _autotune
from . import _blocks
from . import _blocks_mosaic
from . import _launch
from . import _triton
from ._blocks import DEFAULT_CONFIG
from ._blocks import QuantizeConfig
from ._blocks import group_reduce
from ._blocks import per_element
from .bitpack import pack_bits_reference
from .bitpack import packed_words
from .bitpack import unpack_bits_reference

ROW = _launch.ROW


def qsgd_bits(levels: int) -> int:
  """Bits per QSGD code for ``levels`` (sign bit + level in [0, levels]).

  Raises:
    ValueError: ``levels`` not in [1, 32767].
  """
  if not 1 <= levels <= 2**15 - 1:
    raise ValueError(f"{levels=} must be in [1, 32767]")
  need = 1 + math.ceil(math.log2(levels + 1))
  return next(b for b in (2, 4, 8, 16) if b >= need)




# ----------------------------------------------------------------------------
# References (pure jnp): the XLA path and the ground truth of the kernel.
# ----------------------------------------------------------------------------


# Below this a bucket's sum of squares may have lost precision to subnormal
# squares (|x| < 2**-63); see qsgd_norms_reference.
_TINY_SUM_OF_SQUARES = 2.0 ** -100


def _scaled_norms(xf: jax.Array, bucket_size: int) -> jax.Array:
  """The L2 norms with each bucket scaled by the power of two of its largest
  magnitude first (exact), so that no square overflows or vanishes; the
  same bits as ``sqrt(sum(x**2))`` wherever that one is finite and its
  squares normal."""
  n = xf.shape[0]
  top = group_reduce(xf, bucket_size, "max", jnp.abs)
  # top = m * 2**e with m in [0.5, 1); a non-finite or zero top keeps e = 0.
  e = jnp.where(jnp.isfinite(top) & (top > 0), jnp.frexp(top)[1], 0)
  scaled = xf * per_element(jnp.ldexp(jnp.float32(1), -e), bucket_size, n)
  return jnp.ldexp(jnp.sqrt(group_reduce(scaled, bucket_size, "sum",
                                         jnp.square)), e)


def qsgd_norms_reference(x: jax.Array, *, bucket_size: int) -> jax.Array:
  """float32 ``(ceil(n / bucket_size),)``: the L2 norm of each bucket of the
  flat ``x`` (the last one partial), as the XLA path computes it.

  ``sqrt(sum(x**2))``; on a step where a bucket's sum of squares overflows
  (``|x|`` above about ``2**63``: an infinite norm, which QSGD decoded as
  NaN) or lies below ``2**-100`` without being 0 (squares lost to
  subnormals), every norm is computed again with each bucket scaled by a
  power of two first (:func:`_scaled_norms`, in a ``lax.cond`` branch: other
  steps pay nothing, and the norms are the same bits either way where the
  plain sum is sound). A bucket whose entries are all below ``2**-75`` in
  magnitude still has norm 0 (its squares all vanish), and QSGD sends it as
  zeros.

  Raises:
    ValueError: ``bucket_size`` not positive.
  """
  _blocks.check_size("bucket_size", bucket_size)
  xf = x.reshape(-1).astype(jnp.float32)
  plain = group_reduce(xf, bucket_size, "sum", jnp.square)
  unsound = ~jnp.isfinite(plain) | (
      (plain > 0) & (plain < jnp.float32(_TINY_SUM_OF_SQUARES)))
  return jax.lax.cond(jnp.any(unsound),
                      lambda: _scaled_norms(xf, bucket_size),
                      lambda: jnp.sqrt(plain))


def qsgd_codes_reference(x: jax.Array, norms: jax.Array, uniform=None, *,
                         levels: int | jax.Array, bucket_size: int,
                         bits: int | None = None,
                         seed: jax.Array | None = None) -> jax.Array:
  """The packed QSGD codes of ``x`` under the given ``norms`` (see module
  doc): uint32 ``(packed_words(n, bits),)``. :func:`qsgd_quantize_reference`
  is this with XLA's norms; tests feed it a kernel's own norms.

  Args:
    x: float array of ``n`` elements (any shape; flattened).
    norms: float32 ``(ceil(n / bucket_size),)``.
    uniform, seed: the rounding numbers, as in :func:`qsgd_quantize_reference`.
    levels, bucket_size, bits: as in :func:`qsgd_quantize_reference`.

  Raises:
    ValueError: both or neither of ``uniform`` and ``seed``; a bad seed.
  """
  # levels is a concrete int where bits is None (it sets the code width).
  bits = qsgd_bits(cast(int, levels)) if bits is None else bits
  n = x.size
  xf = x.reshape(-1).astype(jnp.float32)
  u = cast(jax.Array, _blocks.dither_source(n, uniform, seed))  # required
  mult = per_element(_blocks.level_multipliers(norms, levels), bucket_size, n)
  r = jnp.abs(xf) * mult
  level = jnp.minimum(jnp.floor(r + u), jnp.float32(levels)).astype(jnp.uint32)
  codes = level | ((xf < 0).astype(jnp.uint32) << (bits - 1))
  return pack_bits_reference(codes, bits)


def qsgd_quantize_reference(x: jax.Array, uniform: jax.Array | None = None, *,
                            levels: int | jax.Array, bucket_size: int,
                            bits: int | None = None,
                            seed: jax.Array | None = None
                            ) -> tuple[jax.Array, jax.Array]:
  """QSGD quantization with stochastic rounding, packed (see module doc).

  Args:
    x: float array of ``n`` elements (any shape; flattened).
    uniform: ``n`` random values, float in [0, 1) or uint32 bits; or None
      with ``seed``.
    levels: number of nonzero levels ``s`` (1 .. 32767); may be a traced
      scalar when ``bits`` is given.
    bucket_size: elements per norm bucket.
    bits: code width; default ``qsgd_bits(levels)``. A wider field than
      ``levels`` needs (a scheduled ``levels`` under its static maximum)
      gives the same levels in more bits.
    seed: uint32 ``(2,)`` hash seed (``dither.seed_of(key)``) instead of
      ``uniform``: element ``i`` rounds with
      ``dither.to_unit(dither.hash_bits(seed, i))``, i.e. the same as
      ``uniform=dither.uniform(key, n)``.

  Returns:
    ``(words, norms)``: uint32 ``(packed_words(n, bits),)`` and float32
    ``(ceil(n / bucket_size),)``.

  Raises:
    ValueError: both or neither of ``uniform`` and ``seed``, bad sizes.
  """
  norms = qsgd_norms_reference(x, bucket_size=bucket_size)
  words = qsgd_codes_reference(x, norms, uniform, levels=levels,
                               bucket_size=bucket_size, bits=bits, seed=seed)
  return words, norms


def qsgd_dequantize_reference(words: jax.Array, norms: jax.Array, *, n: int,
                              levels: int | jax.Array, bucket_size: int,
                              bits: int | None = None) -> jax.Array:
  """Inverse of :func:`qsgd_quantize_reference`: float32 ``(n,)``."""
  # levels is a concrete int where bits is None (it sets the code width).
  bits = qsgd_bits(cast(int, levels)) if bits is None else bits
  codes = unpack_bits_reference(words, bits, n)
  level = (codes & jnp.uint32((1 << (bits - 1)) - 1)).astype(jnp.float32)
  sign = 1.0 - 2.0 * (codes >> (bits - 1)).astype(jnp.float32)
  norm_e = per_element(norms, bucket_size, n)
  return sign * norm_e * level / jnp.float32(levels)


# ----------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernel.
# ----------------------------------------------------------------------------


def _kernel_sqrt(s: jax.Array) -> jax.Array:
  """sqrt of float32 ``s >= 0`` from ``rsqrt`` (Mosaic GPU lowers no sqrt):
  ``y = s * rsqrt(s)`` and one Heron step ``(y + s / y) / 2``; 0 at 0.
  Within an ulp or two of ``jnp.sqrt`` (it is not correctly rounded)."""
  safe = jnp.where(s > 0, s, jnp.float32(1))
  y = safe * jax.lax.rsqrt(safe)
  y = jnp.float32(0.5) * (y + safe / y)
  # s itself where it is 0, or NaN (a bucket holding a NaN keeps a
  # non-finite norm, as jnp.sqrt gives it)
  return jnp.where(s > 0, y, s)


def _qsgd_kernel(x_ref, words_ref, norms_ref: Any = None, *, mult_ref=None,
                 u_ref=None, seed_ref=None, levels: int, bits: int,
                 plan: _blocks_mosaic.Plan, word_major: bool,
                 block: _launch.Block):
  """QSGD codes ``sign << (bits - 1) | level`` packed ``32 / bits`` per
  word, and each bucket's L2 norm (``norms_ref (B,) f32``; or the rows'
  multipliers ``levels / norm`` from ``mult_ref``), rounding with
  ``u_ref`` or ``seed_ref``."""
  xs = _blocks_mosaic.columns(x_ref, plan, block)
  if mult_ref is not None:
    ms = [_blocks_mosaic.per_row(block.row(mult_ref[...]), plan)] * len(xs)
  elif plan.buckets_per_row == 1:
    norms = _kernel_sqrt(_blocks_mosaic.row_total([v * v for v in xs],
                                                  jnp.sum, jnp.add))
    norms_ref[...] = norms
    ms = [_blocks_mosaic.per_row(_blocks.level_multipliers(norms, levels),
                                 plan)] * len(xs)
  else:  # a bucket per column slice: norms_ref (B, buckets_per_row)
    ms = []
    for k, v in enumerate(xs):
      norm = _kernel_sqrt(jnp.sum(v * v, axis=1))
      block.store(norms_ref.at[:, k], norm)
      ms.append(_blocks_mosaic.per_row(
          _blocks.level_multipliers(norm, levels), plan))
  col = block.column_iota(plan.block_groups)
  # QSGD always rounds stochastically: u_ref or seed_ref is given.
  uniform = cast(Callable[[int], jax.Array],
                 _blocks_mosaic.rounding(plan, block, col, u_ref, seed_ref))
  shift = _blocks_mosaic.word_shift(col, bits)
  for k, x in enumerate(xs):
    u = uniform(k)
    r = jnp.abs(x) * ms[k]
    level = jnp.minimum(_blocks.floor_to_int(r + u), levels).astype(jnp.uint32)
    codes = level | ((x < 0).astype(jnp.uint32) << jnp.uint32(bits - 1))
    _blocks_mosaic.store_words(codes, k, words_ref, col=col, shift=shift,
                               bits=bits, word_major=word_major, block=block)


@functools.partial(jax.jit, static_argnames=("levels", "bucket_size", "config",
                                             "interpret"))
def qsgd_quantize(x: jax.Array, uniform: jax.Array | None = None, *,
                  levels: int, bucket_size: int,
                  seed: jax.Array | None = None,
                  config: QuantizeConfig = DEFAULT_CONFIG,
                  interpret: bool | _launch.Interpret = False
              ) -> tuple[jax.Array, jax.Array]:
  """Pallas QSGD: the words of :func:`qsgd_codes_reference` under the norms
  it returns.

  Args:
    x: float array of ``n`` elements (any shape; flattened).
    uniform: ``n`` random values (float in [0, 1) or uint32 bits), read by
      the kernel; or None with ``seed``.
    levels, bucket_size: as in :func:`qsgd_quantize_reference`.
    seed: uint32 ``(2,)`` (``dither.seed_of(key)``): the kernel computes
      element ``i``'s number as ``dither.to_unit(dither.hash_bits(seed, i))``
      itself, so no ``n``-sized random array exists; the same codes as the
      reference given ``uniform=dither.uniform(key, n)``.
    config: kernel block size.
    interpret: run the kernel in interpret mode (any backend); a
      :class:`jaxcomp.kernels.Interpret` for its options.

  Returns:
    ``(words uint32 (packed_words(n, bits),), norms float32
    (ceil(n / bucket_size),))``. With the one-pass kernel (buckets of 32 to
    512 elements whose row count divides ``config.block_rows``) the norms
    are the kernel's (float32 summation order and :func:`_kernel_sqrt` make
    them differ from :func:`qsgd_norms_reference` by a few ulp) and the
    words are exactly :func:`qsgd_codes_reference` under those norms; other
    bucket sizes take XLA's norms and match :func:`qsgd_quantize_reference`
    bit for bit.

  Raises:
    ValueError: ``bucket_size`` is not a multiple of 32, bad ``levels``,
      both or neither of ``uniform`` and ``seed``, a bad ``seed``.
  """
  bits = qsgd_bits(levels)
  if uniform is None and seed is None:
    raise ValueError("stochastic rounding needs uniform= or seed=")
  words, norms = _blocks_mosaic.quantize(
      x, functools.partial(_qsgd_kernel, bits=bits), name="jaxcomp_qsgd_pack",
      stat_name="norms_ref", size_name="bucket_size",
      statistic=lambda xf: jnp.sqrt(group_reduce(xf, bucket_size, "sum",
                                                 jnp.square)),
      multiplier=lambda s: _blocks.level_multipliers(s, levels), bits=bits,
      group=bucket_size, uniform=uniform, seed=seed, config=config,
      interpret=interpret, levels=levels)
  num_buckets = -(-x.size // bucket_size)
  return words[:packed_words(x.size, bits)], norms[:num_buckets]


# ----------------------------------------------------------------------------
# Triton kernel.
# ----------------------------------------------------------------------------


def _triton_kernel(*refs, n: int, bucket_size: int, rows: int, levels: int,
                   bits: int, rounding: str):
  """One Triton program of QSGD (the wire format above): loads ``rows``
  buckets of the flat ``x`` with one masked load (in its dtype; reads past
  ``n`` give 0, whose code is 0 as the reference's padding), reduces each
  bucket's L2 norm in registers (``sqrt`` of float32 sums in the program's
  order), rounds ``|x| * levels / norm`` stochastically (``rounding``:
  ``"seed"`` or ``"array"``, :func:`jaxcomp.kernels._triton.rounding_numbers`)
  and packs the codes ``32 / bits`` per word in wire order into
  ``words_ref``, the norms into ``norms_ref``."""
  x_ref, r_ref, words_ref, norms_ref = refs
  span = rows * bucket_size
  start, offs, x = _triton.load_span(x_ref, span, n)
  x = x.reshape(rows, bucket_size)
  norms = jnp.sqrt(jnp.sum(x * x, axis=1))
  mult = _blocks.level_multipliers(norms, levels)
  u = _triton.rounding_numbers(rounding, r_ref, start, offs, n,
                               (rows, bucket_size))
  assert u is not None  # QSGD always rounds stochastically
  level = jnp.minimum(_blocks.floor_to_int(jnp.abs(x) * mult[:, None] + u),
                      levels).astype(jnp.uint32)
  codes = level | ((x < 0).astype(jnp.uint32) << jnp.uint32(bits - 1))
  per = 32 // bits
  pid = pl.program_id(0)
  _triton.store_span(words_ref, pid * (span // per),
                     _triton.pack_words(codes.reshape(span), bits),
                     -(-n // per))
  _triton.store_span(norms_ref, pid * rows, norms, -(-n // bucket_size))


@functools.partial(jax.jit, static_argnames=(
    "levels", "bits", "bucket_size", "rounding", "rows", "num_warps",
    "interpret"))
def _triton_call(flat, *extra, levels, bits, bucket_size, rounding, rows,
                 num_warps, interpret):
  """``(words uint32 (ceil(n * bits / 32),), norms float32 (ceil(n /
  bucket_size),))`` of the flat ``x`` (``n >= 1``) by
  :func:`_triton_kernel`; ``extra``: the rounding operands
  (:func:`jaxcomp.kernels._triton.rounding_operands`)."""
  n = flat.shape[0]
  num_buckets = -(-n // bucket_size)
  body = functools.partial(_triton_kernel, n=n, bucket_size=bucket_size,
                           rows=rows, levels=levels, bits=bits,
                           rounding=rounding)
  return _triton.launch(
      body,
      (_launch.out_struct((-(-n * bits // 32),), jnp.uint32, flat),
       _launch.out_struct((num_buckets,), jnp.float32, flat)),
      programs=-(-num_buckets // rows), num_warps=num_warps,
      interpret=interpret, name="jaxcomp_qsgd_triton")(flat, *extra)


def qsgd_quantize_triton(x: jax.Array, uniform: jax.Array | None = None, *,
                         levels: int, bucket_size: int,
                         seed: jax.Array | None = None,
                         rows: int | None = None,
                         num_warps: int = _triton.DEFAULT_WARPS,
                         interpret: bool = False
                         ) -> tuple[jax.Array, jax.Array]:
  """QSGD lowered by Triton: one masked pass over ``x`` in its own dtype
  (:func:`_triton_kernel`), no padded or converted copy.

  The same contract as :func:`qsgd_quantize`: the norms are the kernel's
  (``sqrt`` of float32 sums in the program's order, a few ulp from
  :func:`qsgd_norms_reference`) and the words are exactly
  :func:`qsgd_codes_reference` under them. On a step where a norm is not
  finite or below ``2**-49`` (where the reference rescales its buckets,
  :func:`qsgd_norms_reference`), a branch returns
  :func:`qsgd_quantize_reference` itself.

  Written after the int8 kernel of the same form measured 1.7-2.1x XLA on
  an H200 (docs/kernels.md), where the Mosaic QSGD kernel lost to XLA at
  2.5e7 (0.74x) and barely won at 1e8 (1.09x); not yet timed on a GPU
  itself: ``implementation="pallas"`` is the Mosaic kernel, and
  ``implementation=None`` times this one as a candidate on an NVIDIA GPU
  (:func:`qsgd_quantize_auto`; ``python benchmarks/kernels_bench.py --ops
  qsgd``, row ``pallas:triton``).

  Args:
    x: float32, bfloat16 or float16 array of ``n`` elements (any shape).
    uniform, seed: the rounding numbers, as in
      :func:`qsgd_quantize_reference` (exactly one).
    levels: nonzero levels (a static int, 1 .. 32767).
    bucket_size: elements per norm, a power of two from 32 to 8192.
    rows: buckets per program (None: 8, fewer for buckets over 1,024).
    num_warps: warps per program (1, 2, 4, 8 or 16).
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    ``(words uint32 (packed_words(n, bits),), norms float32
    (ceil(n / bucket_size),))``.

  Raises:
    ValueError: bad ``levels``, ``bucket_size`` not a power of two >= 32,
      bad ``rows`` or ``num_warps``, both or neither of ``uniform`` and
      ``seed``, a bad ``seed``.
  """
  bits = qsgd_bits(levels)
  _blocks.rounding_of(uniform, seed, required=True)
  rows = _triton.default_rows(bucket_size) if rows is None else rows
  _triton.check_launch(bucket_size, rows, num_warps)
  if seed is not None:
    seed = _blocks.check_seed(seed)
  if x.size == 0:
    return qsgd_quantize_reference(x, uniform, levels=levels,
                                   bucket_size=bucket_size, seed=seed)
  extra, rounding = _triton.rounding_operands(uniform, seed, required=True)
  words, norms = _triton_call(
      x.reshape(-1), *extra, levels=levels, bits=bits,
      bucket_size=bucket_size, rounding=rounding, rows=rows,
      num_warps=num_warps, interpret=interpret)
  unsound = ~jnp.isfinite(norms) | ((norms > 0) & (norms < 2.0 ** -49))
  return jax.lax.cond(
      jnp.any(unsound),
      lambda: qsgd_quantize_reference(x, uniform, levels=levels,
                                      bucket_size=bucket_size, seed=seed),
      lambda: (words, norms))


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


def qsgd_quantize_auto(x, uniform=None, *, levels, bucket_size, seed=None,
                       implementation: str | None = None):
  """QSGD through a kernel or the reference: ``implementation``
  (``"pallas"``: the Mosaic GPU kernel, :func:`qsgd_quantize`), or with None
  the one :func:`jaxcomp.kernels.resolve_implementation` picks (XLA off
  NVIDIA GPUs; on an NVIDIA GPU the fastest measured of XLA, the Mosaic GPU
  kernel and, for power-of-two buckets where
  ``jaxcomp.kernels._triton.available()``, the Triton kernel,
  :func:`qsgd_quantize_triton`); pass ``uniform`` or ``seed`` as in
  :func:`qsgd_quantize_reference`.

  Returns:
    ``(words, norms)`` as :func:`qsgd_quantize_reference`.

  Raises:
    ValueError: both or neither of ``uniform`` and ``seed``, and what the
      chosen path raises.
  """
  rounding = _blocks.rounding_of(uniform, seed, required=True)
  kernels = {"pallas": qsgd_quantize, "mosaic": qsgd_quantize,
             "triton": qsgd_quantize_triton}

  def run(impl, interpret):
    def f(v, *r):
      u, s = _blocks.split_rounding(rounding, r)
      if impl in kernels:
        return kernels[impl](v, u, levels=levels, bucket_size=bucket_size,
                             seed=s, interpret=interpret)
      return qsgd_quantize_reference(v, u, levels=levels,
                                     bucket_size=bucket_size, seed=s)
    return f

  bits = qsgd_bits(levels)
  supported = bucket_size % ROW == 0
  tunable = _autotune.Tunable(
      op="qsgd", n=x.size, dtype=x.dtype, run=run,
      extras=_blocks.extras_of(rounding),
      params={"bits": bits, "bucket_size": bucket_size,
              "rounding": rounding,
              "in_place": _blocks.in_place(
                  x.size,
                  bucket_size
                  * _blocks_mosaic.buckets_per_row(bucket_size, bits),
                  x.dtype)},
      supported=supported,
      candidates=_autotune.candidates(
          mosaic=supported,
          triton=_triton.available() and _triton.supported_block(bucket_size)))
  choice = _autotune.resolve_implementation(implementation, tunable=tunable)
  return run(choice, False)(x, *_blocks.rounding_args(uniform, seed))
