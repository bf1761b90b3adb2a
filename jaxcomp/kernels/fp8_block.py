"""fp8 block quantization (e4m3, e5m2): the Pallas kernel, its XLA
reference and dispatch.

Wire format: blocks of ``block_size`` elements, ``scales[b] = max|x| / F``
in float32 (``F`` the format's largest finite value: 448 for e4m3, 57344
for e5m2); each element's code is the fp8 byte of ``clip(x * m, -F, F)``
with ``m = 1 / scale`` (0 in a block of zeros), rounded to nearest even as
XLA's ``astype(float8)`` rounds, or stochastically to one of its two fp8
neighbours (unbiased) with uniform numbers given as an array or a seed
(:mod:`jaxcomp.kernels._blocks`). Codes are uint8 ``(n,)``. Decode: each
code's value times its block's scale. A block holding an infinity gets an
infinite scale; one holding a NaN but no infinity is unspecified.

The ``pallas`` implementation runs :func:`fp8_block_quantize_triton` (a
kernel lowered by Triton: one masked pass over ``x`` in its own dtype,
:mod:`jaxcomp.kernels._triton`) for block sizes that are powers of two: on
an NVIDIA H200 it took 0.153 ms for 1e8 float32 (e4m3, nearest) against
XLA's 0.251 ms; the Mosaic GPU kernel (:func:`fp8_block_quantize`) takes
the other multiples of 32. It reads ``x`` once: block maxima,
the multiplier and the fp8 rounding in registers, the rounding with integer
operations only (:func:`_fp8_code`, equal to XLA's conversion bit for bit),
the codes packed 4 per uint32 (the same bytes as the uint8 array). The XLA
path's stochastic rounding and the decoder take codes' values from their
bits (:func:`_fp8_value`), not by XLA's fp8 -> float32 conversion: XLA on a
GPU removes a float32 -> fp8 -> float32 round trip as excess precision.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import _autotune
from . import _blocks
from . import _blocks_mosaic
from . import _launch
from . import _triton
from ._blocks import DEFAULT_CONFIG
from ._blocks import QuantizeConfig
from ._blocks import group_reduce
from ._blocks import per_element

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


# ----------------------------------------------------------------------------
# fp8 codes from integer operations (the kernel's and the references').
# ----------------------------------------------------------------------------


def _fp8_code(y: jax.Array, fmt: str, round_int=None) -> jax.Array:
  """uint32 fp8 codes (0..255) of float32 ``y`` (``|y|`` at most the
  format's largest finite value, or NaN), rounded to nearest even with
  integer operations only, as ``y.astype(float8)`` rounds: the sign from
  ``y``'s sign bit (``-0.0`` keeps it), NaN to the format's NaN.
  ``round_int``: how subnormal codes are rounded to int32 (default
  ``jnp.round``; the Triton kernel passes
  :func:`jaxcomp.kernels._blocks.round_half_even_to_int`, the same
  numbers)."""
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
  scaled = af * jnp.float32(2.0 ** (bias - 1 + mant))
  sub = (jnp.round(scaled) if round_int is None
         else round_int(scaled)).astype(jnp.uint32)
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


# ----------------------------------------------------------------------------
# References (pure jnp): the XLA path and the ground truth of the kernel.
# ----------------------------------------------------------------------------


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
  _blocks.check_size("block_size", block_size)
  _, _, fmax, _, dtype = _fp8_format(format)
  xf = x.reshape(-1).astype(jnp.float32)
  n = xf.shape[0]
  scales = group_reduce(xf, block_size, "max", jnp.abs) / jnp.float32(fmax)
  y = xf * per_element(_blocks.inverse_scales(scales), block_size, n)
  y = jnp.clip(y, -fmax, fmax)  # max|x| / scale may round just above F
  near = jax.lax.bitcast_convert_type(y.astype(dtype), jnp.uint8)
  u = _blocks.dither_source(n, stochastic_uniform, seed, required=False)
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


def _fp8_kernel(x_ref, words_ref, scales_ref=None, *, mult_ref=None,
                u_ref=None, seed_ref=None, fmt: str, plan: _blocks_mosaic.Plan,
                word_major: bool, block: _launch.Block):
  """fp8 codes of ``clip(x * m, -F, F)`` (nearest even, or stochastic with
  ``u_ref`` / ``seed_ref``) as bytes packed 4 per word, and each block's
  scale ``max|x| / F`` (``scales_ref (B,) f32``; or the rows' multipliers
  from ``mult_ref``); ``F`` the format's largest finite value."""
  fmax = FP8_FORMATS[fmt][2]
  xs = _blocks_mosaic.columns(x_ref, plan, block)
  m = _blocks_mosaic.block_multiplier(xs, plan, block, scales_ref, mult_ref,
                                      fmax)
  col = block.column_iota(plan.block_groups)
  uniform = _blocks_mosaic.rounding(plan, block, col, u_ref, seed_ref)
  shift = _blocks_mosaic.word_shift(col, 8)
  for k, x in enumerate(xs):
    u = None if uniform is None else uniform(k)
    y = jnp.clip(x * m, -fmax, fmax)
    codes = _fp8_code(y, fmt)
    if u is not None:
      codes = _fp8_stochastic(y, codes, u, fmt)
    _blocks_mosaic.store_words(codes, k, words_ref, col=col, shift=shift,
                               bits=8, word_major=word_major, block=block)


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
    stochastic_uniform: ``n`` random values read by the kernel, or None.
    seed: uint32 ``(2,)``: stochastic rounding with the numbers computed in
      the kernel (``dither.to_unit(dither.hash_bits(seed, i))``), or None.
    config: kernel block size.
    interpret: run the kernel in interpret mode (any backend); a
      :class:`jaxcomp.kernels.Interpret` for its options.

  Returns:
    ``(codes uint8 (n,), scales float32 (ceil(n / block_size),))``. Non-
    finite inputs follow the int8 blocks' contract: a block holding an
    infinity gets a non-finite scale, one holding only a NaN is
    unspecified, every other block is unaffected.

  Raises:
    ValueError: unknown ``format``, ``block_size`` not a multiple of 32,
      both ``stochastic_uniform`` and ``seed``, a bad ``seed``.
  """
  fmax = _fp8_format(format)[2]
  words, scales = _blocks_mosaic.quantize(
      x, _fp8_kernel, name=f"jaxcomp_fp8_{format}_pack",
      stat_name="scales_ref", size_name="block_size",
      statistic=lambda xf: group_reduce(xf, block_size, "max",
                                        jnp.abs) / jnp.float32(fmax),
      multiplier=_blocks.inverse_scales, bits=8, group=block_size,
      uniform=stochastic_uniform, seed=seed, config=config,
      interpret=interpret, fmt=format)
  num_blocks = -(-x.size // block_size)
  codes = jax.lax.bitcast_convert_type(words, jnp.uint8).reshape(-1)
  return codes[:x.size], scales[:num_blocks]


# ----------------------------------------------------------------------------
# Pallas kernel lowered by Triton.
# ----------------------------------------------------------------------------


@functools.cache
def _fp8_codes(fmt: str):
  """``(y, u) -> uint8 codes`` of one format (one function per format, so
  that the jitted launch sees the same static argument every call)."""
  fmax = FP8_FORMATS[fmt][2]

  def codes(y, u):
    y = jnp.clip(y, -fmax, fmax)
    near = _fp8_code(y, fmt, _blocks.round_half_even_to_int)
    out = near if u is None else _fp8_stochastic(y, near, u, fmt)
    return out.astype(jnp.uint8)
  return codes


def fp8_block_quantize_triton(
    x: jax.Array, *, block_size: int, format: str = "e4m3",  # pylint: disable=redefined-builtin
    stochastic_uniform: jax.Array | None = None,
    seed: jax.Array | None = None,
    rows: int | None = None, num_warps: int = _triton.DEFAULT_WARPS,
    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Pallas fp8 block quantization lowered by Triton: the ``(codes,
  scales)`` of :func:`fp8_block_quantize_reference` bit for bit, in one
  pass over ``x`` (:mod:`jaxcomp.kernels._triton`); the rounding with
  integer operations as in :func:`fp8_block_quantize`.

  Args:
    x: float32, bfloat16 or float16 array of ``n`` elements.
    block_size: elements per scale, a power of two >= 32.
    format: ``"e4m3"`` or ``"e5m2"``.
    stochastic_uniform: ``n`` floats in [0, 1) or uint32 bits, or None.
    seed: uint32 ``(2,)`` for numbers hashed in the kernel, or None.
    rows: blocks per program (None: 8, fewer for blocks over 1,024).
    num_warps: warps per program (1, 2, 4, 8 or 16).
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    ``(codes uint8 (n,), scales float32 (ceil(n / block_size),))``.

  Raises:
    ValueError: unknown ``format``, ``block_size`` not a power of two >=
      32, bad ``rows`` or ``num_warps``, both ``stochastic_uniform`` and
      ``seed``, a bad ``seed``.
  """
  _blocks.check_size("block_size", block_size)
  fmax = _fp8_format(format)[2]
  if seed is not None:
    seed = _blocks.check_seed(seed)
  if x.size == 0:
    return fp8_block_quantize_reference(
        x, block_size=block_size, format=format,
        stochastic_uniform=stochastic_uniform, seed=seed)
  return _triton.block_quantize_call(
      x, _fp8_codes(format), block_size=block_size, top=fmax,
      code_dtype=jnp.uint8, padded=False, name=f"jaxcomp_fp8_{format}_triton",
      uniform=stochastic_uniform, seed=seed, rows=rows, num_warps=num_warps,
      interpret=bool(interpret))


def fp8_block_quantize_pallas(x, *, block_size, format="e4m3", seed=None,  # pylint: disable=redefined-builtin
                              stochastic_uniform=None, interpret=False):
  """The ``pallas`` implementation: the Triton kernel where ``block_size``
  is a power of two, else the Mosaic GPU kernel (any multiple of 32). Where
  the dispatch does not take the Triton kernels
  (``jaxcomp.kernels._triton.available()``: Pallas' Triton backend absent,
  or warning at each lowering as from JAX 0.12) the power-of-two blocks take
  the XLA path (:func:`fp8_block_quantize_reference`)."""
  if _triton.supported_block(block_size):
    if not _triton.available():
      return fp8_block_quantize_reference(
          x, block_size=block_size, format=format,
          stochastic_uniform=stochastic_uniform, seed=seed)
    return fp8_block_quantize_triton(
        x, block_size=block_size, format=format,
        stochastic_uniform=stochastic_uniform, seed=seed,
        interpret=interpret)
  return fp8_block_quantize(x, block_size=block_size, format=format,
                            stochastic_uniform=stochastic_uniform, seed=seed,
                            interpret=interpret)


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


def fp8_block_quantize_auto(x, *, block_size, format="e4m3", seed=None,  # pylint: disable=redefined-builtin
                            implementation: str | None = None):
  """fp8 block quantization through a kernel or the reference:
  ``implementation``, or with None the one
  :func:`jaxcomp.kernels.resolve_implementation` picks (XLA off NVIDIA
  GPUs; on an NVIDIA GPU the fastest measured of XLA, the Mosaic GPU kernel
  and, for power-of-two blocks where ``jaxcomp.kernels._triton.available()``,
  the Triton kernel); pass ``seed`` for stochastic rounding.

  Returns:
    ``(codes, scales)`` as :func:`fp8_block_quantize_reference`.

  Raises:
    ValueError: what the chosen path raises.
  """
  rounding = _blocks.rounding_of(None, seed, required=False)
  kernels = {"pallas": fp8_block_quantize_pallas,
             "mosaic": fp8_block_quantize,
             "triton": fp8_block_quantize_triton}

  def run(impl, interpret):
    def f(v, *r):
      s = _blocks.split_rounding(rounding, r)[1]
      if impl in kernels:
        return kernels[impl](v, block_size=block_size, format=format, seed=s,
                             interpret=interpret)
      return fp8_block_quantize_reference(v, block_size=block_size,
                                          format=format, seed=s)
    return f

  tunable = _blocks.block_tunable(
      "fp8", x, block_size=block_size, rounding=rounding, run=run,
      triton=_triton.available() and _triton.supported_block(block_size),
      format=format)
  choice = _autotune.resolve_implementation(implementation, tunable=tunable)
  return run(choice, False)(x, *_blocks.rounding_args(None, seed))
