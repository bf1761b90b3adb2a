"""Quantize / dequantize kernels: QSGD, sign (1-bit) and int8 block.

Wire formats (what the compressors put on the wire; the Pallas kernels and the
``*_reference`` functions produce identical words, and all packing follows
:mod:`jaxcomp.kernels.bitpack`):

* **QSGD** (Alistarh et al, QSGD: Communication-Efficient SGD via Gradient
  Quantization and Encoding <https://arxiv.org/abs/1610.02132>, 2017).
  The flat input is cut into buckets of ``bucket_size`` elements (the last one
  zero-padded); ``norms[b]`` is the L2 norm of bucket ``b`` (float32).
  Each element gets ``level = min(floor(|x| * m + u), levels)`` with the
  per-bucket float32 multiplier ``m = levels / norm`` (``m = 0`` where
  ``norm == 0``), ``u`` uniform in [0, 1) given by the caller, and the code
  ``sign << (bits - 1) | level`` with ``sign = x < 0``.
  ``bits = qsgd_bits(levels)``, the smallest of 2, 4, 8, 16 that holds
  ``1 + ceil(log2(levels + 1))`` bits. Codes are packed with
  ``pack_bits_reference(codes, bits)`` over the ``n`` real elements.
  Decode: ``(1 - 2 * sign) * norm * level / levels``.
* **sign** (Bernstein et al, signSGD <https://arxiv.org/abs/1802.04434>,
  2018, with the mean-magnitude scale of Karimireddy et al, EF-SGD, 2019):
  bit 1 for ``x < 0``, 0 otherwise (-0.0 gives 0), packed 32 per uint32
  with ``bits=1``; ``scale = mean(|x|)`` in float32.
  Decode: ``scale * (1 - 2 * bit)``.
* **int8 block**: blocks of ``block_size`` elements (last one zero-padded),
  ``scales[b] = max|x| / 127`` in float32, ``q = round_half_even(x * m)``
  or, stochastic, ``floor(x * m + u)`` with ``m = 1 / scale`` (float32,
  ``m = 0`` where ``scale == 0``, so ``q = 0`` there); clipped to [-127, 127]. ``q`` is int8 of length
  ``num_blocks * block_size`` (padding included). Decode: ``q * scale``.

Non-finite inputs (for direct calls: ``jaxcomp.compressed_mean`` screens
non-finite gradients before any encode). Every bucket or block without one
is unaffected, bit for bit. A QSGD bucket holding a NaN or an infinity gets
a non-finite norm on every path; an int8 or fp8 block holding an infinity
gets an infinite scale; the codes of those are unspecified, and decoding
them gives non-finite values, so the failure shows. An int8 or fp8 block
holding a NaN but no infinity is unspecified (XLA's maximum may skip the NaN: its scale can
stay finite). Sign packing gives a NaN bit 0 (``NaN < 0`` is false) and a
non-finite scale. Tested for the kernels against the references.

Multipliers instead of divisions: XLA rewrites ``x / broadcast(s)`` into
``x * broadcast(1 / s)`` on some backends, which moves exact halves by one ulp
and changes codes; computing ``m`` once per bucket and multiplying makes every
backend (and the kernel) produce the same bits.

Random numbers: QSGD and stochastic int8 take either an array of ``n``
uniform numbers (``uniform`` / ``stochastic_uniform``) or a uint32 ``(2,)``
``seed`` (``dither.seed_of(key)``), with which element ``i`` rounds with
``dither.to_unit(dither.hash_bits(seed, i))``, i.e. exactly
``dither.uniform(key, n)[i]``. The references draw those numbers in XLA's
fused expression; the kernels compute them in registers from each element's
flat index (block offset + row * 32 + column), so on the Pallas path with a
seed no ``n``-sized random array exists. The compressors pass the seed.

The Pallas kernels (Mosaic GPU) read ``x`` once (one-pass kernel). ``x`` is
viewed as ``(num_groups, group)``, one bucket (QSGD) / block (int8) per row,
``block_groups = max(64, block_rows // group_rows)`` rows per grid step
(``group_rows = group // 32``); the kernel loads the block's ``group_rows``
column slices of 32 as ``(block_groups, 32)`` WGMMA tiles, reduces each
group in registers (sum of squares, or ``max|x|``), computes the norm /
scale and the multiplier, and quantizes and packs from the same registers.
It writes:

* the packed words as ``(num_groups, group_rows * bits)`` uint32, row-major
  in wire order (word ``k * bits + w`` of a group is word ``w`` of its
  ``k``-th row of 32), so the flat word stream is a free reshape. QSGD's
  2-bit codes in buckets of 32 (2 words and 1 norm a bucket, rows narrower
  than TMA's 16 bytes) take 4 buckets a row: 8 words and 4 norms, in wire
  order too. Where sign packing groups fewer than 4 rows (lengths that are
  not multiples of 1024, to avoid a padding copy) the kernel writes its
  words word-major, ``(group_rows, num_groups)``, and XLA transposes them
  (``n / 32`` words);
* one float32 per group (per bucket): the QSGD norm, the int8 scale, or the
  sign path's sum of ``|x|`` (XLA adds those ``n / group`` values for the
  scale).

QSGD norms are the kernel's: float32 sums in another order than XLA's
``group_reduce``, and a square root from ``rsqrt`` plus one Heron step
(Mosaic GPU lowers no ``sqrt``), so they differ from
:func:`qsgd_norms_reference` by a few ulp; the codes are exactly
:func:`qsgd_codes_reference` under the norms returned. int8 scales are
maxima, the same in any order: the int8 kernel matches the reference bit for
bit. Sign groups 8, 4, 2 or 1 rows (the widest whose tiles fill ``n``).

One pass applies where ``group_rows`` divides ``block_rows`` and the input
blocks fit ``MAX_INPUT_BLOCK_BYTES`` of shared memory: with the default 256
rows, buckets / blocks of 32, 64, 128, 256 and 512 elements given a seed (or
nearest rounding), up to 256 given a uniform array. Other multiples of 32
(96, 160, 640, 1024, ...) fall back to XLA: norms / scales reduced first (a
second read of ``x``) and handed to the kernel as one multiplier per
32-element row (a vector written and read back); those match the reference
bit for bit. Sizes that are not multiples of 32 need ``implementation='xla'``.

Copies that remain: a float32 input whose length is a whole number of
(8, group) tiles is read in place (the last block may be partial: TMA
zero-fills on load); any other input (bf16 / f16, or a ragged length) is
converted and zero-padded once before the kernel, and the outputs are cut to
length after it. int8 codes are packed 4 per uint32 by the kernel
(``bits=8`` little-endian, i.e. the same bytes as the int8 array) and
bit-cast back to int8 for free. ``tests/test_kernel_structure.py`` counts
these from the CUDA export (:mod:`jaxcomp.inspect.kernel_structure`). No GPU
timings of this layout have been measured.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, cast
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _autotune
from . import _launch
from . import dither
from .bitpack import pack_bits_reference
from .bitpack import packed_words
from .bitpack import unpack_bits_reference

ROW = _launch.ROW


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
  """Tuning knobs of the quantize kernels.

  Attributes:
    block_rows: rows of 32 float32 values per grid step (multiple of 64).
      256 rows = 32 KiB of input per buffer in shared memory.
  """
  block_rows: int = 256


DEFAULT_CONFIG = QuantizeConfig()


def qsgd_bits(levels: int) -> int:
  """Bits per QSGD code for ``levels`` (sign bit + level in [0, levels])."""
  if not 1 <= levels <= 2**15 - 1:
    raise ValueError(f"{levels=} must be in [1, 32767]")
  need = 1 + math.ceil(math.log2(levels + 1))
  return next(b for b in (2, 4, 8, 16) if b >= need)


def _uniform_f32(u: jax.Array) -> jax.Array:
  """uint32 random bits -> float32 in [0, 1) (top 24 bits); floats unchanged."""
  if jnp.issubdtype(u.dtype, jnp.unsignedinteger):
    return dither.to_unit(u.astype(jnp.uint32))
  return u.astype(jnp.float32)


def _check_size(name: str, size: int) -> None:
  if size <= 0:
    raise ValueError(f"{name}={size} must be positive")


# ----------------------------------------------------------------------------
# References (pure jnp): the XLA path and the ground truth of the kernels.
# ----------------------------------------------------------------------------


def group_reduce(x: jax.Array, size: int, op: str, elementwise=None
                 ) -> jax.Array:
  """Per-group ``"sum"``/``"max"`` of ``elementwise(x)`` over consecutive
  ``size``-element groups of the flat float32 ``x``: float32
  ``(ceil(n / size),)``, the last group partial.

  Reads ``x`` in place, once: the whole groups are a reshape of it (or, for
  a maximum of a length that ``size`` does not divide, a strided window:
  a reshape of the slice had XLA:CPU write the slice first) and the partial
  one a slice, so no zero-padded copy of ``x`` is made. For a maximum,
  ``elementwise`` (e.g. ``jnp.abs``) is applied to each of those reads
  apart, so that XLA fuses it into the reduction instead of writing
  ``elementwise(x)`` once for both; for a sum (of squares) it is applied
  once, which XLA:CPU reduces faster although it writes it. The result is
  what a zero-padded view gives for the sum of squares and the maximum of
  magnitudes the quantizers take, up to float32 summation order (a maximum
  is the same in any order). A sum over a group holding a NaN or an
  infinity is non-finite; XLA:CPU's maximum skips NaN (making it see NaN
  costs two passes: ``tests/test_memory_passes.py``), so only an infinity
  makes a maximum non-finite."""
  reduce = {"sum": jnp.sum, "max": jnp.max}[op]
  f = elementwise or (lambda v: v)
  n = x.shape[0]
  full = n // size
  if op == "sum":
    # One elementwise(x) shared by the whole groups and the partial one:
    # XLA:CPU then writes it once and sums its rows with its fast
    # reduction (the QSGD step of benchmarks/transform_overhead.py took
    # 7.3 ms this way, 24 ms at commit a9aa0f2, which fused the square and
    # the slice into a generic reduction loop).
    x, f = f(x), (lambda v: v)
  parts = []
  if full and op == "max" and n % size:
    parts.append(jax.lax.reduce_window(f(x), -jnp.inf, jax.lax.max, (size,),
                                       (size,), "VALID"))
  elif full:
    parts.append(reduce(f(x[:full * size]).reshape(full, size), axis=1))
  if n % size:
    parts.append(reduce(f(x[full * size:]), keepdims=True))
  if not parts:
    return jnp.zeros((0,), jnp.float32)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def per_element(values: jax.Array, size: int, n: int) -> jax.Array:
  """``values[i // size]`` for ``i < n``: float32 ``(n,)``, a broadcast that
  XLA fuses into its consumer (``jnp.repeat`` with a static length builds a
  gather from a cumulative sum instead: three passes over ``n``)."""
  nb = values.shape[0]
  return jnp.broadcast_to(values[:, None], (nb, size)).reshape(-1)[:n]


def _qsgd_multiplier(norms, levels):
  safe = jnp.where(norms > 0, norms, jnp.float32(1))
  return jnp.where(norms > 0, jnp.float32(levels) / safe, jnp.float32(0))


def _int8_multiplier(scales):
  safe = jnp.where(scales > 0, scales, jnp.float32(1))
  return jnp.where(scales > 0, jnp.float32(1) / safe, jnp.float32(0))


def _dither_source(n: int, uniform, seed, *, required: bool = True):
  """float32 ``(n,)`` uniform numbers from exactly one of ``uniform`` (an
  array) and ``seed`` (uint32 ``(2,)``), or None where neither is given and
  ``required`` is False."""
  if uniform is not None and seed is not None:
    raise ValueError("pass either uniform random values or a seed, not both")
  if seed is not None:
    return dither.uniform_of_seed(_check_seed(seed), n)
  if uniform is None:
    if required:
      raise ValueError("stochastic rounding needs uniform= or seed=")
    return None
  return _uniform_f32(uniform).reshape(-1)


def _check_seed(seed: jax.Array) -> jax.Array:
  seed = jnp.asarray(seed)
  if seed.shape != (2,) or seed.dtype != jnp.uint32:
    raise ValueError(
        f"seed must be uint32 (2,) (dither.seed_of(key)), got "
        f"{seed.dtype}{seed.shape}")
  return seed


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
  """
  _check_size("bucket_size", bucket_size)
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
  u = cast(jax.Array, _dither_source(n, uniform, seed))  # required: not None
  mult = per_element(_qsgd_multiplier(norms, levels), bucket_size, n)
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


def sign_pack_reference(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """1-bit sign packing: ``(words uint32[ceil(n/32)], scale f32[])``."""
  flat = x.reshape(-1)
  bits = (flat < 0).astype(jnp.uint32)
  scale = jnp.mean(jnp.abs(flat.astype(jnp.float32)))
  return pack_bits_reference(bits, 1), scale


def sign_unpack_reference(words: jax.Array, scale: jax.Array, n: int) -> jax.Array:
  """Inverse of :func:`sign_pack_reference`: float32 ``(n,)``."""
  bit = unpack_bits_reference(words, 1, n).astype(jnp.float32)
  return scale * (1.0 - 2.0 * bit)


def int8_block_quantize_reference(
    x: jax.Array, *, block_size: int,
    stochastic_uniform: jax.Array | None = None,
    seed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """int8 block quantization: ``(q int8[nb * block_size], scales f32[nb])``.

  Nearest rounding by default; stochastic with ``stochastic_uniform`` (``n``
  floats in [0, 1) or uint32 bits) or ``seed`` (uint32 ``(2,)``: element
  ``i`` draws ``dither.to_unit(dither.hash_bits(seed, i))``).

  Raises:
    ValueError: both ``stochastic_uniform`` and ``seed``; bad ``block_size``.
  """
  _check_size("block_size", block_size)
  xf = x.reshape(-1).astype(jnp.float32)
  n = xf.shape[0]
  scales = group_reduce(xf, block_size, "max", jnp.abs) / jnp.float32(127)
  u = _dither_source(n, stochastic_uniform, seed, required=False)
  y = xf * per_element(_int8_multiplier(scales), block_size, n)
  q = jnp.round(y) if u is None else jnp.floor(y + u)
  q = jnp.clip(q, -127, 127).astype(jnp.int8)
  return jnp.pad(q, (0, scales.shape[0] * block_size - n)), scales


def int8_block_dequantize_reference(q: jax.Array, scales: jax.Array, *,
                                    block_size: int, n: int) -> jax.Array:
  """Inverse of :func:`int8_block_quantize_reference`: float32 ``(n,)``."""
  y = q.astype(jnp.float32).reshape(-1, block_size) * scales[:, None]
  return y.reshape(-1)[:n]


# fp8 formats: name -> (mantissa bits, exponent bias, largest finite value,
# NaN code without its sign, dtype).
FP8_FORMATS = {
    "e4m3": (3, 7, 448.0, 0x7F, jnp.float8_e4m3fn),
    "e5m2": (2, 15, 57344.0, 0x7E, jnp.float8_e5m2),
}


def _fp8_format(fmt: str):
  if fmt not in FP8_FORMATS:
    raise ValueError(f"format must be one of {sorted(FP8_FORMATS)}, got {fmt=!r}")
  return FP8_FORMATS[fmt]


def _fp8_code(y: jax.Array, fmt: str) -> jax.Array:
  """uint32 fp8 codes (0..255) of float32 ``y`` (``|y|`` at most the
  format's largest finite value, or NaN), rounded to nearest even with
  integer operations only, as ``y.astype(float8)`` rounds: the sign from
  ``y``'s sign bit (``-0.0`` keeps it), NaN to the format's NaN."""
  mant, bias, _, nan, _ = _fp8_format(fmt)
  u = jax.lax.bitcast_convert_type(y, jnp.uint32)
  sign = (u >> jnp.uint32(31)) << jnp.uint32(7)
  a = u & jnp.uint32(0x7FFFFFFF)
  shift = 23 - mant
  # Normal fp8 numbers: round the float32 mantissa to `mant` bits (a carry
  # moves into the exponent), then rebias the exponent.
  r = (a + jnp.uint32((1 << (shift - 1)) - 1)
       + ((a >> jnp.uint32(shift)) & jnp.uint32(1))) >> jnp.uint32(shift)
  normal = r - jnp.uint32((127 - bias) << mant)
  # Below the smallest normal: multiples of 2**(1 - bias - mant), to even
  # (2**mant of them is the smallest normal's code).
  af = jax.lax.bitcast_convert_type(a, jnp.float32)
  sub = jnp.round(af * jnp.float32(2.0 ** (bias - 1 + mant))).astype(jnp.uint32)
  mag = jnp.where(a >= jnp.uint32((128 - bias) << 23), normal, sub)
  return jnp.where(y != y, sign | jnp.uint32(nan), sign | mag)


def _fp8_value(code: jax.Array, fmt: str) -> jax.Array:
  """float32 value of finite uint32 fp8 codes (exact)."""
  mant, bias, _, _, _ = _fp8_format(fmt)
  mag = code & jnp.uint32(0x7F)
  e = mag >> jnp.uint32(mant)
  m = mag & jnp.uint32((1 << mant) - 1)
  normal = jax.lax.bitcast_convert_type(
      ((e + jnp.uint32(127 - bias)) << jnp.uint32(23)) | (m << jnp.uint32(23 - mant)),
      jnp.float32)
  sub = m.astype(jnp.float32) * jnp.float32(2.0 ** (1 - bias - mant))
  v = jnp.where(e > 0, normal, sub)
  return jnp.where((code & jnp.uint32(0x80)) > 0, -v, v)


def _fp8_stochastic(y, near, u, fmt: str) -> jax.Array:
  """Stochastic rounding from the nearest code ``near``: the neighbour one
  step away in magnitude (towards ``y``) with probability ``|y - near| /
  gap``, which makes it unbiased. The gap between neighbours is a power of
  two, so the probability is ``|y - near|`` times its exact reciprocal
  (exponent bits ``254 - e``), the same number a division gives."""
  near_f = _fp8_value(near, fmt)
  away = jnp.abs(near_f) < jnp.abs(y)
  mag = (near & jnp.uint32(0x7F)).astype(jnp.int32)
  mag = jnp.clip(mag + jnp.where(away, 1, -1), 0, 0x7F).astype(jnp.uint32)
  other = mag | jnp.where(y < 0, jnp.uint32(0x80), jnp.uint32(0))
  gap = jnp.abs(_fp8_value(other, fmt) - near_f)
  inv = jax.lax.bitcast_convert_type(
      jnp.uint32(254 << 23) - jax.lax.bitcast_convert_type(
          jnp.where(gap > 0, gap, jnp.float32(1)), jnp.uint32), jnp.float32)
  p_other = jnp.where(gap > 0, jnp.abs(y - near_f) * inv, jnp.float32(0))
  out = jnp.where(u < p_other, other, near)
  return jnp.where(y != y, near, out)


def fp8_block_quantize_reference(
    x: jax.Array, *, block_size: int, format: str = "e4m3",  # pylint: disable=redefined-builtin
    stochastic_uniform: jax.Array | None = None,
    seed: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """fp8 block quantization in XLA: ``(codes uint8 (n,), scales float32
  (ceil(n / block_size),))``.

  Per block ``scale = max|x| / F`` (``F``: 448 for e4m3, 57344 for e5m2);
  ``y = x * (1 / scale)`` (0 in a block of zeros), clipped to ``[-F, F]``
  and converted by XLA (``astype(float8)``, nearest even), or rounded
  stochastically to one of its two fp8 neighbours with ``stochastic_uniform``
  (``n`` floats in [0, 1)) or ``seed`` (uint32 ``(2,)``, element ``i``
  drawing ``dither.to_unit(dither.hash_bits(seed, i))``): from XLA's nearest
  code, with the kernel's arithmetic (the codes' values taken from their
  bits), so that the codes are the kernel's bit for bit on every backend.

  Raises:
    ValueError: unknown ``format``; both ``stochastic_uniform`` and
      ``seed``; bad ``block_size``.
  """
  _check_size("block_size", block_size)
  _, _, fmax, _, dtype = _fp8_format(format)
  xf = x.reshape(-1).astype(jnp.float32)
  n = xf.shape[0]
  scales = group_reduce(xf, block_size, "max", jnp.abs) / jnp.float32(fmax)
  y = xf * per_element(_int8_multiplier(scales), block_size, n)
  y = jnp.clip(y, -fmax, fmax)  # max|x| / scale may round just above F
  near = jax.lax.bitcast_convert_type(y.astype(dtype), jnp.uint8)
  u = _dither_source(n, stochastic_uniform, seed, required=False)
  if u is None:
    return near, scales
  # From XLA's nearest code, the kernel's own arithmetic: the codes' values
  # from their bits, not by converting ``near`` back to float32. XLA on a
  # GPU removes a float32 -> fp8 -> float32 round trip as excess precision
  # (SimplifyFPConversions, with xla_allow_excess_precision on by
  # default), which made ``near``'s value ``y`` itself, the probability 0
  # and the codes nearest rather than stochastic there.
  return _fp8_stochastic(y, near.astype(jnp.uint32), u, format).astype(jnp.uint8), scales


def fp8_block_dequantize_reference(codes: jax.Array, scales: jax.Array, *,
                                   block_size: int, n: int,
                                   format: str = "e4m3") -> jax.Array:  # pylint: disable=redefined-builtin
  """Inverse of :func:`fp8_block_quantize_reference`: float32 ``(n,)``, each
  code's value times its block's scale.

  The values are taken from the codes' bits (exact for every finite code;
  NaN codes decode to unspecified values), not by XLA's fp8 -> float32
  conversion: in a program that also encodes (a local decode of one's own
  payload), XLA on a GPU would fold that conversion with the encoder's
  float32 -> fp8 one and decode the unrounded value (excess precision).

  Args:
    codes: uint8 ``(m,)`` fp8 codes, ``m >= n``.
    scales: float32 ``(ceil(n / block_size),)`` (or more).
    block_size: elements per scale.
    n: elements to decode.
    format: ``"e4m3"`` or ``"e5m2"``.

  Raises:
    ValueError: unknown ``format``.
  """
  _fp8_format(format)
  v = _fp8_value(codes.reshape(-1)[:n].astype(jnp.uint32), format)
  return v * per_element(scales.astype(jnp.float32), block_size, n)


# ----------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernel.
# ----------------------------------------------------------------------------


def _floor_to_int(v: jax.Array) -> jax.Array:
  """floor(v) as int32 with only truncating conversion (no floor on Mosaic)."""
  t = v.astype(jnp.int32)
  return t - (t.astype(jnp.float32) > v).astype(jnp.int32)


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


# Shared memory the one-pass kernel's (block_groups, group) float32 input
# blocks may take: x, plus the uniform numbers when they come as an array.
# 64 groups (one WGMMA row tile) of 16 rows of x are 128 KiB; Mosaic GPU
# allows 227 KiB per block, outputs included.
MAX_INPUT_BLOCK_BYTES = 128 * 1024


@dataclasses.dataclass(frozen=True)
class _Plan:
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


def _one_pass_plan(group: int, block_rows: int, inputs: int = 1, bits: int = 8
                   ) -> _Plan | None:
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
  per_row = _buckets_per_row(group, bits)
  group *= per_row
  g = group // ROW
  if block_rows % g:
    return None
  block_groups = max(64, block_rows // g)
  if inputs * block_groups * group * 4 > MAX_INPUT_BLOCK_BYTES:
    return None
  return _Plan(group=group, block_groups=block_groups, in_kernel=True,
               buckets_per_row=per_row)


def _buckets_per_row(group: int, bits: int) -> int:
  """Buckets a row of the kernel's view holds: 4 where one bucket's words
  (``group / 32 * bits``) would make rows narrower than TMA's 16 bytes
  (QSGD's 2-bit codes in buckets of 32; 4 norms make 16 bytes), else 1."""
  return 4 if group == ROW and bits < 4 else 1


def _sign_plan(n: int, block_rows: int) -> _Plan:
  """Sign packing groups rows only to shrink its per-group ``|x|`` sums: the
  widest group of 8, 4, 2 or 1 rows whose (8, group) tiles ``n`` fills, else
  8 rows (and a padding copy)."""
  for g in (8, 4, 2, 1):
    if n % (8 * ROW * g) == 0:
      break
  else:
    g = 8
  return _Plan(group=g * ROW, block_groups=max(64, block_rows // g),
               in_kernel=True)


def _to_groups(v: jax.Array, plan: _Plan):
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
  if flat.dtype in _IN_PLACE and n % tile == 0 and n:
    padded = n
  else:
    padded = max(tile, -(-n // tile) * tile)
    flat = jnp.pad(flat.astype(jnp.float32), (0, padded - n))
  num_groups = padded // plan.group
  return (flat.reshape(num_groups, plan.group),
          -(-num_groups // plan.block_groups))


# Input dtypes the kernels read in place (converted to float32 in registers).
_IN_PLACE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


def _groups_spec(plan: _Plan, dtype=jnp.float32):
  """BlockSpec of ``block_groups`` rows of a ``(num_groups, group)`` array
  (float32, or 16-bit floats read in place); column slices of 32 of it are
  ``(block_groups, 32)`` tiles: 128 bytes wide for float32, 64 for 16-bit
  types (the swizzle follows the tile's width in bytes)."""
  return _launch.tiled_spec((plan.block_groups, plan.group), lambda i: (i, 0),
                            dtype)


SEED_WORDS = 32  # the seed travels as 128 bytes: TMA copies whole warpgroups

# What every quantize kernel below shares. A block holds ``B =
# block_groups`` groups (buckets / blocks) of ``group_rows`` rows of 32; the
# kernel loads the ``group_rows`` column slices of 32 as ``(B, 32)`` tiles,
# reduces each group in registers where it computes its statistic, encodes
# each slice and packs it into ``bits`` words per row of 32, and writes
# ``words_ref (B, group_rows * bits) uint32``: word ``k * bits + w`` of a
# group is word ``w`` of its ``k``-th row of 32, so the flat output is the
# wire's word stream (``(group_rows * bits, B)`` instead where
# ``word_major``). Refs the kernels may take besides: ``mult_ref (B,) f32``,
# the multiplier of each row's bucket / block computed by XLA (the fallback
# of groups that do not fit one pass, ``group == 32``); ``u_ref (B, group)
# f32`` the uniform rounding numbers, or ``seed_ref (32,) uint32`` (words 0,
# 1: the hash seed, the numbers computed from each element's flat index).


def _columns(x_ref, plan: _Plan, block: _launch.Block) -> list[jax.Array]:
  """The block's ``group_rows`` column slices of 32, float32 ``(B, 32)``."""
  return [block.tile(x_ref[:, pl.ds(ROW * k, ROW)]).astype(jnp.float32)
          for k in range(plan.group_rows)]


def _row_total(values: list[jax.Array], reduce, combine) -> jax.Array:
  """``reduce`` along the rows of each value (one at least), combined: one
  per group."""
  total = reduce(values[0], axis=1)
  for v in values[1:]:
    total = combine(total, reduce(v, axis=1))
  return total


def _per_row(m: jax.Array, plan: _Plan) -> jax.Array:
  """A per-group ``(B,)`` value broadcast along the rows, ``(B, 32)``."""
  return jax.lax.broadcast_in_dim(m, (plan.block_groups, ROW), (0,))


def _rounding(plan: _Plan, block: _launch.Block, col, u_ref, seed_ref):
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


def _word_shift(col, bits: int):
  """Bit offset of each element's code in its word."""
  return (col % jnp.uint32(32 // bits)) * jnp.uint32(bits)


def _store_words(codes, k: int, words_ref, *, col, shift, bits: int,
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


def _block_multiplier(xs, plan, block, scales_ref, mult_ref, top: float):
  """int8 / fp8: each block's scale ``max|x| / top`` (written to
  ``scales_ref``) and its multiplier, or the rows' multipliers from
  ``mult_ref``, broadcast along the rows."""
  if mult_ref is None:
    scales = _row_total([jnp.abs(v) for v in xs], jnp.max,
                        jnp.maximum) / jnp.float32(top)
    scales_ref[...] = scales
    m = _int8_multiplier(scales)
  else:
    m = block.row(mult_ref[...])
  return _per_row(m, plan)


def _sign_kernel(x_ref, words_ref, abs_sums_ref, *, plan: _Plan,
                 word_major: bool, block: _launch.Block):
  """Sign bits (``x < 0``) packed 32 per word, and each group's sum of
  ``|x|`` (``abs_sums_ref (B,) f32``: XLA adds them for the scale)."""
  xs = _columns(x_ref, plan, block)
  abs_sums_ref[...] = _row_total([jnp.abs(v) for v in xs], jnp.sum, jnp.add)
  col = block.column_iota(plan.block_groups)
  shift = _word_shift(col, 1)
  for k, x in enumerate(xs):
    _store_words((x < 0).astype(jnp.uint32), k, words_ref, col=col,
                 shift=shift, bits=1, word_major=word_major, block=block)


def _qsgd_kernel(x_ref, words_ref, norms_ref: Any = None, *, mult_ref=None,
                 u_ref=None, seed_ref=None, levels: int, bits: int,
                 plan: _Plan, word_major: bool, block: _launch.Block):
  """QSGD codes ``sign << (bits - 1) | level`` packed ``32 / bits`` per
  word, and each bucket's L2 norm (``norms_ref (B,) f32``; or the rows'
  multipliers ``levels / norm`` from ``mult_ref``), rounding with
  ``u_ref`` or ``seed_ref``."""
  xs = _columns(x_ref, plan, block)
  if mult_ref is not None:
    ms = [_per_row(block.row(mult_ref[...]), plan)] * len(xs)
  elif plan.buckets_per_row == 1:
    norms = _kernel_sqrt(_row_total([v * v for v in xs], jnp.sum, jnp.add))
    norms_ref[...] = norms
    ms = [_per_row(_qsgd_multiplier(norms, levels), plan)] * len(xs)
  else:  # a bucket per column slice: norms_ref (B, buckets_per_row)
    ms = []
    for k, v in enumerate(xs):
      norm = _kernel_sqrt(jnp.sum(v * v, axis=1))
      block.store(norms_ref.at[:, k], norm)
      ms.append(_per_row(_qsgd_multiplier(norm, levels), plan))
  col = block.column_iota(plan.block_groups)
  # QSGD always rounds stochastically: u_ref or seed_ref is given.
  uniform = cast(Callable[[int], jax.Array],
                 _rounding(plan, block, col, u_ref, seed_ref))
  shift = _word_shift(col, bits)
  for k, x in enumerate(xs):
    u = uniform(k)
    r = jnp.abs(x) * ms[k]
    level = jnp.minimum(_floor_to_int(r + u), levels).astype(jnp.uint32)
    codes = level | ((x < 0).astype(jnp.uint32) << jnp.uint32(bits - 1))
    _store_words(codes, k, words_ref, col=col, shift=shift, bits=bits,
                 word_major=word_major, block=block)


def _int8_kernel(x_ref, words_ref, scales_ref=None, *, mult_ref=None,
                 u_ref=None, seed_ref=None, plan: _Plan, word_major: bool,
                 block: _launch.Block):
  """int8 codes ``clip(round(x * m), -127, 127)`` (or ``floor(x * m + u)``
  with ``u_ref`` / ``seed_ref``) as bytes packed 4 per word, and each
  block's scale ``max|x| / 127`` (``scales_ref (B,) f32``; or the rows'
  multipliers from ``mult_ref``)."""
  xs = _columns(x_ref, plan, block)
  m = _block_multiplier(xs, plan, block, scales_ref, mult_ref, 127)
  col = block.column_iota(plan.block_groups)
  uniform = _rounding(plan, block, col, u_ref, seed_ref)
  shift = _word_shift(col, 8)
  for k, x in enumerate(xs):
    u = None if uniform is None else uniform(k)
    y = x * m
    q = jnp.round(y).astype(jnp.int32) if u is None else _floor_to_int(y + u)
    codes = (jnp.clip(q, -127, 127) & 0xFF).astype(jnp.uint32)
    _store_words(codes, k, words_ref, col=col, shift=shift, bits=8,
                 word_major=word_major, block=block)


def _fp8_kernel(x_ref, words_ref, scales_ref=None, *, mult_ref=None,
                u_ref=None, seed_ref=None, fmt: str, plan: _Plan,
                word_major: bool, block: _launch.Block):
  """fp8 codes of ``clip(x * m, -F, F)`` (nearest even, or stochastic with
  ``u_ref`` / ``seed_ref``) as bytes packed 4 per word, and each block's
  scale ``max|x| / F`` (``scales_ref (B,) f32``; or the rows' multipliers
  from ``mult_ref``); ``F`` the format's largest finite value."""
  fmax = FP8_FORMATS[fmt][2]
  xs = _columns(x_ref, plan, block)
  m = _block_multiplier(xs, plan, block, scales_ref, mult_ref, fmax)
  col = block.column_iota(plan.block_groups)
  uniform = _rounding(plan, block, col, u_ref, seed_ref)
  shift = _word_shift(col, 8)
  for k, x in enumerate(xs):
    u = None if uniform is None else uniform(k)
    y = jnp.clip(x * m, -fmax, fmax)
    codes = _fp8_code(y, fmt)
    if u is not None:
      codes = _fp8_stochastic(y, codes, u, fmt)
    _store_words(codes, k, words_ref, col=col, shift=shift, bits=8,
                 word_major=word_major, block=block)


# op -> (kernel, bits of a code, name of its per-group statistic's ref).
_KERNELS = {"sign": (_sign_kernel, "abs_sums_ref"),
            "qsgd": (_qsgd_kernel, "norms_ref"),
            "int8": (_int8_kernel, "scales_ref"),
            "fp8": (_fp8_kernel, "scales_ref")}


def _quantize_pack_call(op: str, x_groups, row_mult, u_groups, seed, *,
                        bits: int, plan: _Plan, grid: int, interpret,
                        **statics):
  """Runs ``op``'s kernel: ``(words uint32 (num_groups * group_rows * bits,),
  statistic float32 (num_groups,) or None)``, ``words`` already in wire
  order. ``statics``: the kernel's own (``levels``, ``fmt``)."""
  kernel, stat_name = _KERNELS[op]
  operands = [x_groups]
  # pl.BlockSpecs, and plgpu.BlockSpecs where TMA tiles the block.
  inputs: list[tuple[str, Any]] = [
      ("x_ref", _groups_spec(plan, x_groups.dtype))]
  if row_mult is not None:
    operands.append(row_mult)
    inputs.append(("mult_ref", _launch.vector_spec(plan.block_groups)))
  if u_groups is not None:
    operands.append(u_groups)
    inputs.append(("u_ref", _groups_spec(plan)))
  elif seed is not None:
    operands.append(jnp.pad(_check_seed(seed), (0, SEED_WORDS - 2)))
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
    per_row = plan.buckets_per_row
    outputs.append((stat_name,
                    _launch.out_struct((num_groups, per_row), jnp.float32, x_groups),
                    pl.BlockSpec((plan.block_groups, per_row), lambda i: (i, 0))))
  elif plan.in_kernel:
    outputs.append((stat_name,
                    _launch.out_struct((num_groups,), jnp.float32, x_groups),
                    _launch.vector_spec(plan.block_groups)))
  if op == "qsgd":
    statics["bits"] = bits
  out = _launch.blocked_call(
      functools.partial(kernel, plan=plan, word_major=word_major, **statics),
      grid=grid,
      inputs=inputs,
      outputs=outputs,
      interpret=interpret,
      name=f"jaxcomp_{op if op != 'fp8' else 'fp8_' + statics['fmt']}_pack",
  )(*operands)
  # Row-major (group, word) is the wire's order.
  words = (out[0].T if word_major else out[0]).reshape(-1)
  return words, (out[1].reshape(-1) if plan.in_kernel else None)


def _row_values(per_group: jax.Array, group: int, num_rows: int) -> jax.Array:
  return _launch.pad_rows_vector(jnp.repeat(per_group, group // ROW), num_rows)


def _check_pallas_group(name: str, group: int) -> None:
  if group % ROW:
    raise ValueError(
        f"the Pallas path needs bucket/block sizes that are multiples of {ROW},"
        f" got {name}={group}; use implementation='xla'")


def _quantize(x, op: str, *, bits, group, multiplier, top, uniform, seed,
              config, interpret, **statics):
  """The QSGD / int8 / fp8 Pallas path: one pass where :func:`_one_pass_plan`
  applies, else XLA reduces the groups first and the kernel gets one
  multiplier per row. Returns ``(words, per-group statistic)`` with
  ``words`` of ``ceil(n / group) * group * bits / 32`` (or more) words.
  ``top``: what a block's ``max|x|`` maps to (int8 / fp8)."""
  _launch.check_block_rows(config.block_rows)
  _check_size("bucket_size" if op == "qsgd" else "block_size", group)
  _check_pallas_group("bucket_size" if op == "qsgd" else "block_size", group)
  if uniform is not None and seed is not None:
    raise ValueError("pass either uniform random values or a seed, not both")
  plan = _one_pass_plan(group, config.block_rows,
                        inputs=1 if uniform is None else 2, bits=bits)
  u_source = None if uniform is None else _uniform_f32(uniform)
  if plan is not None:
    xg, grid = _to_groups(x, plan)
    ug = None if u_source is None else _to_groups(u_source, plan)[0]
    words, stat = _quantize_pack_call(
        op, xg, None, ug, seed, bits=bits, plan=plan, grid=grid,
        interpret=interpret, **statics)
    return words, cast(jax.Array, stat)  # one-pass plans reduce in the kernel
  # Fallback: XLA's per-group statistic, handed over as per-row multipliers.
  xf = x.reshape(-1).astype(jnp.float32)
  if op == "qsgd":
    stat = jnp.sqrt(group_reduce(xf, group, "sum", jnp.square))
  else:
    stat = group_reduce(xf, group, "max", jnp.abs) / jnp.float32(top)
  plan = _Plan(group=ROW, block_groups=config.block_rows, in_kernel=False)
  xg, grid = _to_groups(x, plan)
  ug = None if u_source is None else _to_groups(u_source, plan)[0]
  row_mult = _row_values(multiplier(stat), group, xg.shape[0])
  words, _ = _quantize_pack_call(
      op, xg, row_mult, ug, seed, bits=bits, plan=plan, grid=grid,
      interpret=interpret, **statics)
  return words, stat


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sign_pack(x: jax.Array, *, config: QuantizeConfig = DEFAULT_CONFIG,
              interpret: bool | _launch.Interpret = False
              ) -> tuple[jax.Array, jax.Array]:
  """Pallas sign packing: the words of :func:`sign_pack_reference`, and its
  scale up to float32 summation order (the kernel sums ``|x|`` per group of
  rows as it packs, so the scale costs no second pass over ``x``).

  Returns:
    ``(words uint32 (ceil(n / 32),), scale float32 ())``.

  Raises:
    ValueError: ``config.block_rows`` not a positive multiple of 64.
  """
  _launch.check_block_rows(config.block_rows)
  n = x.size
  plan = _sign_plan(n, config.block_rows)
  xg, grid = _to_groups(x, plan)
  words, group_abs = _quantize_pack_call(
      "sign", xg, None, None, None, bits=1, plan=plan, grid=grid,
      interpret=interpret)
  # The sign plan reduces in the kernel: the statistic is there.
  scale = jnp.sum(cast(jax.Array, group_abs)) / jnp.float32(n)
  return words[:packed_words(n, 1)], scale


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
  words, norms = _quantize(
      x, "qsgd", bits=bits, group=bucket_size,
      multiplier=lambda s: _qsgd_multiplier(s, levels), top=None,
      uniform=uniform, seed=seed, config=config, interpret=interpret,
      levels=levels)
  num_buckets = -(-x.size // bucket_size)
  return words[:packed_words(x.size, bits)], norms[:num_buckets]


@functools.partial(jax.jit, static_argnames=("block_size", "config",
                                             "interpret"))
def int8_block_quantize(
    x: jax.Array, *, block_size: int,
    stochastic_uniform: jax.Array | None = None,
    seed: jax.Array | None = None,
    config: QuantizeConfig = DEFAULT_CONFIG,
    interpret: bool | _launch.Interpret = False
    ) -> tuple[jax.Array, jax.Array]:
  """Pallas int8 block quantization; the same ``(q, scales)`` as
  :func:`int8_block_quantize_reference` bit for bit (a maximum does not
  depend on the order it is taken in).

  Args:
    x: float array of ``n`` elements.
    block_size: elements per scale, a multiple of 32.
    stochastic_uniform: ``n`` random values read by the kernel, or None.
    seed: uint32 ``(2,)``: stochastic rounding with the numbers computed in
      the kernel (``dither.to_unit(dither.hash_bits(seed, i))``), or None.
    config, interpret: as in :func:`qsgd_quantize`.

  Returns:
    ``(q int8 (num_blocks * block_size,), scales float32 (num_blocks,))``.

  Raises:
    ValueError: ``block_size`` is not a multiple of 32, both
      ``stochastic_uniform`` and ``seed``, a bad ``seed``.
  """
  words, scales = _quantize(
      x, "int8", bits=8, group=block_size, multiplier=_int8_multiplier,
      top=127, uniform=stochastic_uniform, seed=seed, config=config,
      interpret=interpret)
  num_blocks = -(-x.size // block_size)
  scales = scales[:num_blocks]
  q = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(-1)
  padded = num_blocks * block_size
  if q.size < padded:  # rows end before the last scale block does
    q = jnp.pad(q, (0, padded - q.size))
  return q[:padded], scales


def fp8_block_quantize(
    x: jax.Array, *, block_size: int, format: str = "e4m3",  # pylint: disable=redefined-builtin
    stochastic_uniform: jax.Array | None = None,
    seed: jax.Array | None = None,
    config: QuantizeConfig = DEFAULT_CONFIG,
    interpret: bool | _launch.Interpret = False
    ) -> tuple[jax.Array, jax.Array]:
  """Pallas fp8 block quantization: the ``(codes, scales)`` of
  :func:`fp8_block_quantize_reference` bit for bit, in one pass over ``x``
  (block maxima, the multiplier and the fp8 rounding in registers; the
  rounding with integer operations, as XLA's conversion rounds; the
  stochastic numbers hashed in the kernel from the seed).

  Args:
    x: float array of ``n`` elements.
    block_size: elements per scale, a multiple of 32.
    format: ``"e4m3"`` or ``"e5m2"``.
    stochastic_uniform, seed, config, interpret: as in
      :func:`int8_block_quantize`.

  Returns:
    ``(codes uint8 (n,), scales float32 (ceil(n / block_size),))``. Non-
    finite inputs follow the module's contract for int8 blocks: a block
    holding an infinity gets a non-finite scale, one holding only a NaN is
    unspecified, every other block is unaffected.

  Raises:
    ValueError: unknown ``format``, ``block_size`` not a multiple of 32,
      both ``stochastic_uniform`` and ``seed``, a bad ``seed``.
  """
  _fp8_format(format)
  words, scales = _quantize(
      x, "fp8", bits=8, group=block_size, multiplier=_int8_multiplier,
      top=FP8_FORMATS[format][2], uniform=stochastic_uniform, seed=seed,
      config=config, interpret=interpret, fmt=format)
  num_blocks = -(-x.size // block_size)
  codes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
  return codes[:x.size], scales[:num_blocks]


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


def _scratch_seed(x: jax.Array) -> tuple:
  """A seed for a scratch run of an op (autotuning)."""
  del x
  return (jnp.array([0x9E3779B9, 7], jnp.uint32),)


def _scratch_uniform(x: jax.Array) -> tuple:
  """Uniform numbers for a scratch run of an op (autotuning)."""
  return (jax.random.uniform(jax.random.key(1), (x.size,), jnp.float32),)


def _in_place(n: int, group: int, dtype) -> bool:
  """Whether the Pallas path reads ``x`` in place (whole (8, group) tiles
  of a float32 or 16-bit float), or pays a padding copy."""
  return n > 0 and n % (8 * group) == 0 and jnp.dtype(dtype) in _IN_PLACE


def _rounding_of(uniform, seed, *, required: bool) -> str:
  """``"seed"``, ``"array"`` (uniform numbers passed in) or ``"nearest"``.

  Raises:
    ValueError: both ``uniform`` and ``seed``, or neither where
      ``required``.
  """
  if uniform is not None and seed is not None:
    raise ValueError("pass either uniform random values or a seed, not both")
  if uniform is None and seed is None and required:
    raise ValueError("stochastic rounding needs uniform= or seed=")
  return "seed" if seed is not None else (
      "array" if uniform is not None else "nearest")


def _extras_of(rounding: str):
  return {"seed": _scratch_seed, "array": _scratch_uniform}.get(
      rounding, lambda x: ())


def _split_rounding(rounding: str, r: tuple):
  """``(uniform, seed)`` from a scratch run's extra operands."""
  return ((None, r[0]) if rounding == "seed"
          else (r[0], None) if rounding == "array" else (None, None))


def qsgd_quantize_auto(x, uniform=None, *, levels, bucket_size, seed=None,
                       implementation: str | None = None):
  """QSGD through the kernel or the reference: ``implementation``, or with
  None the one :func:`jaxcomp.kernels.resolve_implementation` picks (XLA
  off NVIDIA GPUs, the faster one measured on an NVIDIA GPU); pass
  ``uniform`` or ``seed`` as in :func:`qsgd_quantize_reference`.

  Raises:
    ValueError: both or neither of ``uniform`` and ``seed``, and what the
      chosen path raises.
  """
  rounding = _rounding_of(uniform, seed, required=True)

  def run(impl, interpret):
    def f(v, *r):
      u, s = _split_rounding(rounding, r)
      if impl == "pallas":
        return qsgd_quantize(v, u, levels=levels, bucket_size=bucket_size,
                             seed=s, interpret=interpret)
      return qsgd_quantize_reference(v, u, levels=levels,
                                     bucket_size=bucket_size, seed=s)
    return f

  tunable = _autotune.Tunable(
      op="qsgd", n=x.size, dtype=x.dtype, run=run, extras=_extras_of(rounding),
      params={"bits": qsgd_bits(levels), "bucket_size": bucket_size,
              "rounding": rounding,
              "in_place": _in_place(
                  x.size, bucket_size * _buckets_per_row(bucket_size, qsgd_bits(levels)),
                  x.dtype)},
      supported=bucket_size % ROW == 0)
  if _autotune.resolve_implementation(implementation,
                                      tunable=tunable) == "pallas":
    return qsgd_quantize(x, uniform, levels=levels, bucket_size=bucket_size,
                         seed=seed)
  return qsgd_quantize_reference(x, uniform, levels=levels,
                                 bucket_size=bucket_size, seed=seed)


def sign_pack_auto(x, *, implementation: str | None = None):
  """Sign packing through the kernel or the reference (``implementation``,
  or with None as :func:`qsgd_quantize_auto` picks)."""

  def run(impl, interpret):
    if impl == "pallas":
      return lambda v: sign_pack(v, interpret=interpret)
    return sign_pack_reference

  tunable = _autotune.Tunable(
      op="sign", n=x.size, dtype=x.dtype, run=run,
      params={"in_place": _in_place(x.size, ROW, x.dtype)})
  if _autotune.resolve_implementation(implementation,
                                      tunable=tunable) == "pallas":
    return sign_pack(x)
  return sign_pack_reference(x)


def _block_tunable(op: str, x, *, block_size, rounding: str, run, **params):
  return _autotune.Tunable(
      op=op, n=x.size, dtype=x.dtype, run=run, extras=_extras_of(rounding),
      params={"block_size": block_size, "rounding": rounding,
              "in_place": _in_place(x.size, block_size, x.dtype), **params},
      supported=block_size % ROW == 0)


def fp8_block_quantize_auto(x, *, block_size, format="e4m3", seed=None,  # pylint: disable=redefined-builtin
                            implementation: str | None = None):
  """fp8 block quantization through the kernel or the reference
  (``implementation``, or with None as :func:`qsgd_quantize_auto` picks);
  pass ``seed`` for stochastic rounding."""
  rounding = _rounding_of(None, seed, required=False)

  def run(impl, interpret):
    def f(v, *r):
      s = _split_rounding(rounding, r)[1]
      if impl == "pallas":
        return fp8_block_quantize(v, block_size=block_size, format=format,
                                  seed=s, interpret=interpret)
      return fp8_block_quantize_reference(v, block_size=block_size,
                                          format=format, seed=s)
    return f

  tunable = _block_tunable("fp8", x, block_size=block_size, rounding=rounding,
                           run=run, format=format)
  if _autotune.resolve_implementation(implementation,
                                      tunable=tunable) == "pallas":
    return fp8_block_quantize(x, block_size=block_size, format=format, seed=seed)
  return fp8_block_quantize_reference(x, block_size=block_size, format=format,
                                      seed=seed)


def int8_block_quantize_auto(x, *, block_size, stochastic_uniform=None,
                             seed=None, implementation: str | None = None):
  """int8 block quantization through the kernel or the reference
  (``implementation``, or with None as :func:`qsgd_quantize_auto` picks);
  pass ``stochastic_uniform`` or ``seed`` for stochastic rounding."""
  rounding = _rounding_of(stochastic_uniform, seed, required=False)

  def run(impl, interpret):
    def f(v, *r):
      u, s = _split_rounding(rounding, r)
      if impl == "pallas":
        return int8_block_quantize(v, block_size=block_size,
                                   stochastic_uniform=u, seed=s,
                                   interpret=interpret)
      return int8_block_quantize_reference(v, block_size=block_size,
                                           stochastic_uniform=u, seed=s)
    return f

  tunable = _block_tunable("int8", x, block_size=block_size,
                           rounding=rounding, run=run)
  if _autotune.resolve_implementation(implementation,
                                      tunable=tunable) == "pallas":
    return int8_block_quantize(x, block_size=block_size,
                               stochastic_uniform=stochastic_uniform, seed=seed)
  return int8_block_quantize_reference(x, block_size=block_size,
                                       stochastic_uniform=stochastic_uniform,
                                       seed=seed)
