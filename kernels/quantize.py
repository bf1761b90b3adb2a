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

Multipliers instead of divisions: XLA rewrites ``x / broadcast(s)`` into
``x * broadcast(1 / s)`` on some backends, which moves exact halves by one ulp
and changes codes; computing ``m`` once per bucket and multiplying makes every
backend (and the kernel) produce the same bits.

The Pallas kernels (Mosaic GPU) fuse the per-element arithmetic and the bit
packing in one pass over ``x``; the per-bucket norms / scales and the sign scale
are XLA reductions computed first (one more read of ``x``) and handed to the
kernel as one value per 32-element row, which is why the Pallas path needs
``bucket_size`` and ``block_size`` to be multiples of 32. Inputs of bf16 / f16
are converted to float32 before the kernel. int8 codes are packed 4 per uint32
by the kernel (``bits=8`` little-endian, i.e. the same bytes as the int8 array)
and bit-cast back to int8 for free.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl

from . import _select
from .bitpack import pack_bits_reference
from .bitpack import packed_words
from .bitpack import unpack_bits_reference

ROW = _select.ROW


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
    return (u.astype(jnp.uint32) >> 8).astype(jnp.float32) * jnp.float32(2**-24)
  return u.astype(jnp.float32)


def _check_size(name: str, size: int) -> None:
  if size <= 0:
    raise ValueError(f"{name}={size} must be positive")


# ----------------------------------------------------------------------------
# References (pure jnp): the XLA path and the ground truth of the kernels.
# ----------------------------------------------------------------------------


def group_reduce(x: jax.Array, size: int, op: str) -> jax.Array:
  """Per-group ``"sum"``/``"max"`` of consecutive ``size``-element groups of
  the flat float32 ``x``: float32 ``(ceil(n / size),)``, the last group
  partial. Reads ``x`` in place: the whole groups are a reshape of it and the
  partial one a slice, so no zero-padded copy of ``x`` is made (the result
  is what a zero-padded view gives for the sum of squares and the maximum
  of magnitudes the quantizers take, up to float32 summation order)."""
  reduce = {"sum": jnp.sum, "max": jnp.max}[op]
  n = x.shape[0]
  full = n // size
  parts = []
  if full:
    parts.append(reduce(x[:full * size].reshape(full, size), axis=1))
  if n % size:
    parts.append(reduce(x[full * size:], keepdims=True))
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


def qsgd_quantize_reference(x: jax.Array, uniform: jax.Array, *, levels: int,
                            bucket_size: int, bits: int | None = None
                            ) -> tuple[jax.Array, jax.Array]:
  """QSGD quantization with stochastic rounding, packed (see module doc).

  Args:
    x: float array of ``n`` elements (any shape; flattened).
    uniform: ``n`` random values, float in [0, 1) or uint32 bits.
    levels: number of nonzero levels ``s`` (1 .. 32767); may be a traced
      scalar when ``bits`` is given.
    bucket_size: elements per norm bucket.
    bits: code width; default ``qsgd_bits(levels)``. A wider field than
      ``levels`` needs (a scheduled ``levels`` under its static maximum)
      gives the same levels in more bits.

  Returns:
    ``(words, norms)``: uint32 ``(packed_words(n, bits),)`` and float32
    ``(ceil(n / bucket_size),)``.
  """
  bits = qsgd_bits(levels) if bits is None else bits
  _check_size("bucket_size", bucket_size)
  n = x.size
  xf = x.reshape(-1).astype(jnp.float32)
  norms = jnp.sqrt(group_reduce(xf * xf, bucket_size, "sum"))
  u = _uniform_f32(uniform).reshape(-1)
  mult = per_element(_qsgd_multiplier(norms, levels), bucket_size, n)
  r = jnp.abs(xf) * mult
  level = jnp.minimum(jnp.floor(r + u), jnp.float32(levels)).astype(jnp.uint32)
  codes = level | ((xf < 0).astype(jnp.uint32) << (bits - 1))
  return pack_bits_reference(codes, bits), norms


def qsgd_dequantize_reference(words: jax.Array, norms: jax.Array, *, n: int,
                              levels: int, bucket_size: int,
                              bits: int | None = None) -> jax.Array:
  """Inverse of :func:`qsgd_quantize_reference`: float32 ``(n,)``."""
  bits = qsgd_bits(levels) if bits is None else bits
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
    stochastic_uniform: jax.Array | None = None) -> tuple[jax.Array, jax.Array]:
  """int8 block quantization: ``(q int8[nb * block_size], scales f32[nb])``."""
  _check_size("block_size", block_size)
  xf = x.reshape(-1).astype(jnp.float32)
  n = xf.shape[0]
  scales = group_reduce(jnp.abs(xf), block_size, "max") / jnp.float32(127)
  y = xf * per_element(_int8_multiplier(scales), block_size, n)
  if stochastic_uniform is None:
    q = jnp.round(y)
  else:
    q = jnp.floor(y + _uniform_f32(stochastic_uniform).reshape(-1))
  q = jnp.clip(q, -127, 127).astype(jnp.int8)
  return jnp.pad(q, (0, scales.shape[0] * block_size - n)), scales


def int8_block_dequantize_reference(q: jax.Array, scales: jax.Array, *,
                                    block_size: int, n: int) -> jax.Array:
  """Inverse of :func:`int8_block_quantize_reference`: float32 ``(n,)``."""
  y = q.astype(jnp.float32).reshape(-1, block_size) * scales[:, None]
  return y.reshape(-1)[:n]


# ----------------------------------------------------------------------------
# Pallas (Mosaic GPU) kernel.
# ----------------------------------------------------------------------------


def _floor_to_int(v: jax.Array) -> jax.Array:
  """floor(v) as int32 with only truncating conversion (no floor on Mosaic)."""
  t = v.astype(jnp.int32)
  return t - (t.astype(jnp.float32) > v).astype(jnp.int32)


def _quantize_pack_kernel(*refs, mode: str, bits: int, levels: int,
                          stochastic: bool, block_rows: int, interpret: bool):
  """One block of rows -> ``bits`` packed words per row.

  Refs: ``x_ref (R, 32) f32``, then for ``qsgd``/``int8`` ``mult_ref (R,)``
  (the multiplier ``m`` of each row's bucket / block), then if ``stochastic``
  ``u_ref (R, 32) f32``; output ``o_ref (bits, R) uint32`` where ``o_ref[w, r]``
  is word ``w`` of row ``r``, and for ``sign`` also ``abs_ref (R,) f32``, the
  sum of ``|x|`` over each row (so the scale needs no second pass over ``x``).
  """
  refs = list(refs)
  x_ref = refs.pop(0)
  mult_ref = refs.pop(0) if mode != "sign" else None
  u_ref = refs.pop(0) if stochastic else None
  o_ref = refs.pop(0)
  x = _select.wgmma(x_ref[...], interpret)
  if mode == "sign":
    (abs_ref,) = refs  # per-row sums of |x|, for the scale
    abs_ref[...] = jnp.sum(jnp.abs(x), axis=1)
    codes = (x < 0).astype(jnp.uint32)
  else:
    m = _select.wgmma_row(mult_ref[...], interpret)
    m = jax.lax.broadcast_in_dim(m, x.shape, (0,))
    u = _select.wgmma(u_ref[...], interpret) if stochastic else None
    if mode == "qsgd":
      r = jnp.abs(x) * m
      level = jnp.minimum(_floor_to_int(r + u), levels).astype(jnp.uint32)
      codes = level | ((x < 0).astype(jnp.uint32) << jnp.uint32(bits - 1))
    else:  # int8
      y = x * m
      q = _floor_to_int(y + u) if stochastic else jnp.round(y).astype(jnp.int32)
      q = jnp.clip(q, -127, 127)
      codes = (q & 0xFF).astype(jnp.uint32)
  per_word = 32 // bits
  col = _select.column_iota(block_rows, interpret)
  shifted = codes << ((col % jnp.uint32(per_word)) * jnp.uint32(bits))
  for w in range(bits):
    if bits == 1:
      part = shifted
    else:
      part = jnp.where(col // jnp.uint32(per_word) == jnp.uint32(w), shifted,
                       jnp.uint32(0))
    o_ref[w] = jnp.sum(part, axis=1, dtype=jnp.uint32)


def _quantize_pack_call(x_rows, row_mult, u_rows, *, mode, bits, levels,
                        block_rows, grid, interpret):
  stochastic = u_rows is not None
  operands = [x_rows]
  in_specs = [_select.rows_spec(block_rows, interpret)]
  if row_mult is not None:
    operands.append(row_mult)
    in_specs.append(_select.vector_spec(block_rows))
  if stochastic:
    operands.append(u_rows)
    in_specs.append(_select.rows_spec(block_rows, interpret))
  num_rows = x_rows.shape[0]
  out_shape = _select.out_struct((bits, num_rows), jnp.uint32, x_rows)
  out_specs = pl.BlockSpec((bits, block_rows), lambda i: (0, i))
  if mode == "sign":
    out_shape = [out_shape,
                 _select.out_struct((num_rows,), jnp.float32, x_rows)]
    out_specs = [out_specs, _select.vector_spec(block_rows)]
  out = _select.blocked_call(
      functools.partial(
          _quantize_pack_kernel, mode=mode, bits=bits, levels=levels,
          stochastic=stochastic, block_rows=block_rows, interpret=interpret),
      out_shape,
      grid=grid,
      in_specs=in_specs,
      out_specs=out_specs,
      interpret=interpret,
      name=f"jaxcomp_{mode}_pack",
  )(*operands)
  extra = None
  if mode == "sign":
    out, extra = out
  # Word w of row r is element r * bits + w of the packed stream.
  return out.T.reshape(-1), extra


def _row_values(per_group: jax.Array, group: int, num_rows: int) -> jax.Array:
  if group % ROW:
    raise ValueError(
        f"the Pallas path needs bucket/block sizes that are multiples of {ROW},"
        f" got {group}; use implementation='xla'")
  return _select.pad_rows_vector(jnp.repeat(per_group, group // ROW), num_rows)


@functools.partial(jax.jit, static_argnames=("config", "interpret"))
def sign_pack(x: jax.Array, *, config: QuantizeConfig = DEFAULT_CONFIG,
              interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Pallas sign packing: the words of :func:`sign_pack_reference`, and its
  scale up to float32 summation order (the kernel sums ``|x|`` per row as it
  packs, so the scale costs no second pass over ``x``)."""
  _select.check_block_rows(config.block_rows)
  n = x.size
  rows, grid = _select.to_rows(x, config.block_rows, interpret=interpret)
  words, row_abs = _quantize_pack_call(
      rows, None, None, mode="sign", bits=1, levels=0,
      block_rows=config.block_rows, grid=grid, interpret=interpret)
  scale = jnp.sum(row_abs) / jnp.float32(n)
  return words[:packed_words(n, 1)], scale


@functools.partial(jax.jit, static_argnames=("levels", "bucket_size", "config",
                                             "interpret"))
def qsgd_quantize(x: jax.Array, uniform: jax.Array, *, levels: int,
                  bucket_size: int, config: QuantizeConfig = DEFAULT_CONFIG,
                  interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Pallas QSGD; same outputs as :func:`qsgd_quantize_reference`.

  Raises:
    ValueError: ``bucket_size`` is not a multiple of 32, bad ``levels``.
  """
  _select.check_block_rows(config.block_rows)
  bits = qsgd_bits(levels)
  _check_size("bucket_size", bucket_size)
  n = x.size
  xf = x.reshape(-1).astype(jnp.float32)
  norms = jnp.sqrt(group_reduce(xf * xf, bucket_size, "sum"))
  rows, grid = _select.to_rows(x, config.block_rows, interpret=interpret)
  u_rows, _ = _select.to_rows(_uniform_f32(uniform), config.block_rows,
                              interpret=interpret)
  row_mult = _row_values(_qsgd_multiplier(norms, levels), bucket_size,
                        rows.shape[0])
  words, _ = _quantize_pack_call(
      rows, row_mult, u_rows, mode="qsgd", bits=bits, levels=levels,
      block_rows=config.block_rows, grid=grid, interpret=interpret)
  return words[:packed_words(n, bits)], norms


@functools.partial(jax.jit, static_argnames=("block_size", "config",
                                             "interpret"))
def int8_block_quantize(
    x: jax.Array, *, block_size: int,
    stochastic_uniform: jax.Array | None = None,
    config: QuantizeConfig = DEFAULT_CONFIG,
    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Pallas int8 block quantization; same as the reference.

  Raises:
    ValueError: ``block_size`` is not a multiple of 32.
  """
  _select.check_block_rows(config.block_rows)
  _check_size("block_size", block_size)
  scales = group_reduce(jnp.abs(x.reshape(-1).astype(jnp.float32)),
                        block_size, "max") / jnp.float32(127)
  rows, grid = _select.to_rows(x, config.block_rows, interpret=interpret)
  u_rows = None
  if stochastic_uniform is not None:
    u_rows, _ = _select.to_rows(_uniform_f32(stochastic_uniform),
                                config.block_rows, interpret=interpret)
  row_mult = _row_values(_int8_multiplier(scales), block_size,
                        rows.shape[0])
  words, _ = _quantize_pack_call(
      rows, row_mult, u_rows, mode="int8", bits=8, levels=0,
      block_rows=config.block_rows, grid=grid, interpret=interpret)
  q = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(-1)
  padded = scales.shape[0] * block_size
  if q.size < padded:  # rows end before the last scale block does
    q = jnp.pad(q, (0, padded - q.size))
  return q[:padded], scales


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


def qsgd_quantize_auto(x, uniform, *, levels, bucket_size,
                       implementation: str | None = None):
  """QSGD through the kernel or the reference (``_select`` policy)."""
  if _select.resolve_implementation(implementation, op="qsgd", n=x.size,
                                    dtype=x.dtype) == "pallas":
    return qsgd_quantize(x, uniform, levels=levels, bucket_size=bucket_size)
  return qsgd_quantize_reference(x, uniform, levels=levels,
                                 bucket_size=bucket_size)


def sign_pack_auto(x, *, implementation: str | None = None):
  """Sign packing through the kernel or the reference (``_select`` policy)."""
  if _select.resolve_implementation(implementation, op="sign", n=x.size,
                                    dtype=x.dtype) == "pallas":
    return sign_pack(x)
  return sign_pack_reference(x)


def int8_block_quantize_auto(x, *, block_size, stochastic_uniform=None,
                             implementation: str | None = None):
  """int8 block quantization through the kernel or the reference."""
  if _select.resolve_implementation(implementation, op="int8", n=x.size,
                                    dtype=x.dtype) == "pallas":
    return int8_block_quantize(x, block_size=block_size,
                               stochastic_uniform=stochastic_uniform)
  return int8_block_quantize_reference(x, block_size=block_size,
                                       stochastic_uniform=stochastic_uniform)
