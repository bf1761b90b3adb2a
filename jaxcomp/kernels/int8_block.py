"""int8 block quantization: the Pallas kernel, its XLA reference and
dispatch.

Wire format: blocks of ``block_size`` elements (the last one zero-padded),
``scales[b] = max|x| / 127`` in float32, ``q = round_half_even(x * m)`` or,
stochastic, ``floor(x * m + u)`` with ``m = 1 / scale`` (float32, ``m = 0``
where ``scale == 0``, so ``q = 0`` there); clipped to [-127, 127]. ``q`` is
int8 of length ``num_blocks * block_size`` (padding included). Decode: ``q *
scale``. A block holding an infinity gets an infinite scale; one holding a
NaN but no infinity is unspecified (XLA's maximum may skip the NaN).

Two Pallas kernels. :func:`int8_block_quantize_triton`, lowered by Triton,
is the one the ``pallas`` implementation runs (block sizes that are powers
of two): one masked pass over ``x`` in its own dtype, the partial last
block included (:mod:`jaxcomp.kernels._triton`); on an NVIDIA H200 it took
0.149 ms for 1e8 float32 against XLA's 0.253 ms. The Mosaic GPU kernel
(:func:`int8_block_quantize`) takes the other multiples of 32. It reads ``x`` once: each block is
one row of its view of ``x``, its scale reduced in registers, the codes
packed 4 per uint32 (the same bytes as the int8 array, bit-cast back for
free). Scales are maxima, the same in any order: the kernel matches
:func:`int8_block_quantize_reference` bit for bit. The rounding numbers
are those of every quantizer (:mod:`jaxcomp.kernels._blocks`), the layout
and launch those of every Mosaic GPU quantizer kernel
(:mod:`jaxcomp.kernels._blocks_mosaic`).
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


# ----------------------------------------------------------------------------
# References (pure jnp): the XLA path and the ground truth of the kernel.
# ----------------------------------------------------------------------------


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
  _blocks.check_size("block_size", block_size)
  xf = x.reshape(-1).astype(jnp.float32)
  n = xf.shape[0]
  scales = group_reduce(xf, block_size, "max", jnp.abs) / jnp.float32(127)
  u = _blocks.dither_source(n, stochastic_uniform, seed, required=False)
  y = xf * per_element(_blocks.inverse_scales(scales), block_size, n)
  q = jnp.round(y) if u is None else jnp.floor(y + u)
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


def _int8_kernel(x_ref, words_ref, scales_ref=None, *, mult_ref=None,
                 u_ref=None, seed_ref=None, plan: _blocks_mosaic.Plan,
                 word_major: bool, block: _launch.Block):
  """int8 codes ``clip(round(x * m), -127, 127)`` (or ``floor(x * m + u)``
  with ``u_ref`` / ``seed_ref``) as bytes packed 4 per word, and each
  block's scale ``max|x| / 127`` (``scales_ref (B,) f32``; or the rows'
  multipliers from ``mult_ref``)."""
  xs = _blocks_mosaic.columns(x_ref, plan, block)
  m = _blocks_mosaic.block_multiplier(xs, plan, block, scales_ref, mult_ref,
                                      127)
  col = block.column_iota(plan.block_groups)
  uniform = _blocks_mosaic.rounding(plan, block, col, u_ref, seed_ref)
  shift = _blocks_mosaic.word_shift(col, 8)
  for k, x in enumerate(xs):
    u = None if uniform is None else uniform(k)
    y = x * m
    q = (jnp.round(y).astype(jnp.int32) if u is None
         else _blocks.floor_to_int(y + u))
    codes = (jnp.clip(q, -127, 127) & 0xFF).astype(jnp.uint32)
    _blocks_mosaic.store_words(codes, k, words_ref, col=col, shift=shift,
                               bits=8, word_major=word_major, block=block)


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
    config: kernel block size.
    interpret: run the kernel in interpret mode (any backend); a
      :class:`jaxcomp.kernels.Interpret` for its options.

  Returns:
    ``(q int8 (num_blocks * block_size,), scales float32 (num_blocks,))``.

  Raises:
    ValueError: ``block_size`` is not a multiple of 32, both
      ``stochastic_uniform`` and ``seed``, a bad ``seed``.
  """
  words, scales = _blocks_mosaic.quantize(
      x, _int8_kernel, name="jaxcomp_int8_pack", stat_name="scales_ref",
      size_name="block_size",
      statistic=lambda xf: group_reduce(xf, block_size, "max",
                                        jnp.abs) / jnp.float32(127),
      multiplier=_blocks.inverse_scales, bits=8, group=block_size,
      uniform=stochastic_uniform, seed=seed, config=config,
      interpret=interpret)
  num_blocks = -(-x.size // block_size)
  scales = scales[:num_blocks]
  q = jax.lax.bitcast_convert_type(words, jnp.int8).reshape(-1)
  padded = num_blocks * block_size
  if q.size < padded:  # rows end before the last scale block does
    q = jnp.pad(q, (0, padded - q.size))
  return q[:padded], scales


# ----------------------------------------------------------------------------
# Pallas kernel lowered by Triton.
# ----------------------------------------------------------------------------


def _int8_codes(y: jax.Array, u: jax.Array | None) -> jax.Array:
  """int8 codes of ``y = x * m``: nearest even, or ``floor(y + u)``."""
  q = (_blocks.round_half_even_to_int(y) if u is None
       else _blocks.floor_to_int(y + u))
  return jnp.clip(q, -127, 127).astype(jnp.int8)


def int8_block_quantize_triton(
    x: jax.Array, *, block_size: int,
    stochastic_uniform: jax.Array | None = None,
    seed: jax.Array | None = None,
    rows: int | None = None, num_warps: int = _triton.DEFAULT_WARPS,
    interpret: bool = False) -> tuple[jax.Array, jax.Array]:
  """Pallas int8 block quantization lowered by Triton: the ``(q, scales)``
  of :func:`int8_block_quantize_reference` bit for bit, in one pass over
  ``x`` (:mod:`jaxcomp.kernels._triton`).

  Args:
    x: float32, bfloat16 or float16 array of ``n`` elements (read in its
      own dtype, flat).
    block_size: elements per scale, a power of two >= 32.
    stochastic_uniform: ``n`` floats in [0, 1) or uint32 bits, or None.
    seed: uint32 ``(2,)``: stochastic rounding with the numbers hashed in
      the kernel (``dither.to_unit(dither.hash_bits(seed, i))``), or None.
    rows: blocks per program (None: 8, fewer for blocks over 1,024).
    num_warps: warps per program (1, 2, 4, 8 or 16).
    interpret: run in Pallas' interpret mode (any backend).

  Returns:
    ``(q int8 (num_blocks * block_size,), scales float32 (num_blocks,))``.

  Raises:
    ValueError: ``block_size`` not a power of two >= 32 (use
      :func:`int8_block_quantize` or the reference), bad ``rows`` or
      ``num_warps``, both ``stochastic_uniform`` and ``seed``, a bad
      ``seed``.
  """
  _blocks.check_size("block_size", block_size)
  if seed is not None:
    seed = _blocks.check_seed(seed)
  if x.size == 0:
    return int8_block_quantize_reference(
        x, block_size=block_size, stochastic_uniform=stochastic_uniform,
        seed=seed)
  return _triton.block_quantize_call(
      x, _int8_codes, block_size=block_size, top=127.0, code_dtype=jnp.int8,
      padded=True, name="jaxcomp_int8_triton", uniform=stochastic_uniform,
      seed=seed, rows=rows, num_warps=num_warps, interpret=bool(interpret))


def int8_block_quantize_pallas(x, *, block_size, stochastic_uniform=None,
                               seed=None, interpret=False):
  """The ``pallas`` implementation: the Triton kernel where ``block_size``
  is a power of two, else the Mosaic GPU kernel (any multiple of 32). Where
  the dispatch does not take the Triton kernels
  (``jaxcomp.kernels._triton.available()``: Pallas' Triton backend absent,
  or warning at each lowering as from JAX 0.12) the power-of-two blocks take
  the XLA path (:func:`int8_block_quantize_reference`), which was faster
  than the Mosaic GPU kernel on an H200."""
  if _triton.supported_block(block_size):
    if not _triton.available():
      return int8_block_quantize_reference(
          x, block_size=block_size, stochastic_uniform=stochastic_uniform,
          seed=seed)
    return int8_block_quantize_triton(
        x, block_size=block_size, stochastic_uniform=stochastic_uniform,
        seed=seed, interpret=interpret)
  return int8_block_quantize(x, block_size=block_size,
                             stochastic_uniform=stochastic_uniform, seed=seed,
                             interpret=interpret)


# ----------------------------------------------------------------------------
# Dispatch by implementation.
# ----------------------------------------------------------------------------


def int8_block_quantize_auto(x, *, block_size, stochastic_uniform=None,
                             seed=None, implementation: str | None = None):
  """int8 block quantization through a kernel or the reference:
  ``implementation``, or with None the one
  :func:`jaxcomp.kernels.resolve_implementation` picks (XLA off NVIDIA
  GPUs; on an NVIDIA GPU the fastest measured of XLA, the Mosaic GPU kernel
  and, for power-of-two blocks where ``jaxcomp.kernels._triton.available()``,
  the Triton kernel); pass ``stochastic_uniform`` or ``seed`` for stochastic
  rounding.

  Returns:
    ``(q, scales)`` as :func:`int8_block_quantize_reference`.

  Raises:
    ValueError: both ``stochastic_uniform`` and ``seed``, and what the
      chosen path raises.
  """
  rounding = _blocks.rounding_of(stochastic_uniform, seed, required=False)
  kernels = {"pallas": int8_block_quantize_pallas,
             "mosaic": int8_block_quantize,
             "triton": int8_block_quantize_triton}

  def run(impl, interpret):
    def f(v, *r):
      u, s = _blocks.split_rounding(rounding, r)
      if impl in kernels:
        return kernels[impl](v, block_size=block_size, stochastic_uniform=u,
                             seed=s, interpret=interpret)
      return int8_block_quantize_reference(v, block_size=block_size,
                                           stochastic_uniform=u, seed=s)
    return f

  tunable = _blocks.block_tunable(
      "int8", x, block_size=block_size, rounding=rounding, run=run,
      triton=_triton.available() and _triton.supported_block(block_size))
  choice = _autotune.resolve_implementation(implementation, tunable=tunable)
  return run(choice, False)(
      x, *_blocks.rounding_args(stochastic_uniform, seed))
