"""What the block quantizers share: per-group statistics, rounding numbers
and the dispatch's parts; the Pallas (Mosaic GPU) kernel's layout and launch
are :mod:`jaxcomp.kernels._blocks_mosaic`, the Triton kernels' shared parts
:mod:`jaxcomp.kernels._triton`.

The quantizers (:mod:`~jaxcomp.kernels.sign`, :mod:`~jaxcomp.kernels.qsgd`,
:mod:`~jaxcomp.kernels.int8_block`, :mod:`~jaxcomp.kernels.fp8_block`) each
keep their wire format, kernel body, jitted Pallas wrapper, ``*_reference``
and ``*_auto`` dispatch in their own module; this one holds what those
modules have in common. All packing follows :mod:`jaxcomp.kernels.bitpack`.

Non-finite inputs (for direct calls: ``jaxcomp.compressed_mean`` screens
non-finite gradients before any encode). Every bucket or block without one
is unaffected, bit for bit. A QSGD bucket holding a NaN or an infinity gets
a non-finite norm on every path; an int8 or fp8 block holding an infinity
gets an infinite scale; the codes of those are unspecified, and decoding
them gives non-finite values, so the failure shows. An int8 or fp8 block
holding a NaN but no infinity is unspecified (XLA's maximum may skip the
NaN: its scale can stay finite). Sign packing gives a NaN bit 0 (``NaN <
0`` is false) and a non-finite scale. Tested for the kernels against the
references.

Multipliers instead of divisions: XLA rewrites ``x / broadcast(s)`` into
``x * broadcast(1 / s)`` on some backends, which moves exact halves by one
ulp and changes codes; computing the multiplier once per bucket / block
and multiplying makes every backend (and the kernel) produce the same bits.

Random numbers: QSGD and stochastic int8 / fp8 take either an array of
``n`` uniform numbers (``uniform`` / ``stochastic_uniform``) or a uint32
``(2,)`` ``seed`` (``dither.seed_of(key)``), with which element ``i``
rounds with ``dither.to_unit(dither.hash_bits(seed, i))``, i.e. exactly
``dither.uniform(key, n)[i]``. The references draw those numbers in XLA's
fused expression; the kernels compute them in registers from each
element's flat index (block offset + row * 32 + column), so on the Pallas
path with a seed no ``n``-sized random array exists. The compressors pass
the seed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import jax.numpy as jnp

from . import _autotune
from . import _launch
from . import dither

ROW = _launch.ROW


@dataclasses.dataclass(frozen=True)
class QuantizeConfig:
  """Tuning knobs of the quantize kernels (sign, QSGD, int8 and fp8 blocks).

  Attributes:
    block_rows: rows of 32 float32 values per grid step (multiple of 64).
      256 rows = 32 KiB of input per buffer in shared memory.
  """
  block_rows: int = 256


DEFAULT_CONFIG = QuantizeConfig()


def check_size(name: str, size: int) -> None:
  """Raises ValueError unless the bucket / block size ``size`` is positive."""
  if size <= 0:
    raise ValueError(f"{name}={size} must be positive")


def uniform_f32(u: jax.Array) -> jax.Array:
  """uint32 random bits -> float32 in [0, 1) (top 24 bits); floats unchanged."""
  if jnp.issubdtype(u.dtype, jnp.unsignedinteger):
    return dither.to_unit(u.astype(jnp.uint32))
  return u.astype(jnp.float32)


# ----------------------------------------------------------------------------
# Per-group statistics and rounding numbers (XLA): the references' parts.
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


def inverse_scales(scales: jax.Array) -> jax.Array:
  """The int8 / fp8 multipliers ``1 / scale``, 0 where a scale is 0 (a
  block of zeros, whose codes are then 0)."""
  safe = jnp.where(scales > 0, scales, jnp.float32(1))
  return jnp.where(scales > 0, jnp.float32(1) / safe, jnp.float32(0))


def level_multipliers(norms: jax.Array, levels) -> jax.Array:
  """QSGD's multipliers ``levels / norm``, 0 where a norm is 0 (a bucket of
  zeros, whose levels are then 0)."""
  safe = jnp.where(norms > 0, norms, jnp.float32(1))
  return jnp.where(norms > 0, jnp.float32(levels) / safe, jnp.float32(0))


def check_seed(seed: jax.Array) -> jax.Array:
  """``seed`` as a uint32 ``(2,)`` array.

  Raises:
    ValueError: another dtype or shape.
  """
  seed = jnp.asarray(seed)
  if seed.shape != (2,) or seed.dtype != jnp.uint32:
    raise ValueError(
        f"seed must be uint32 (2,) (dither.seed_of(key)), got "
        f"{seed.dtype}{seed.shape}")
  return seed


def dither_source(n: int, uniform, seed, *, required: bool = True):
  """float32 ``(n,)`` uniform numbers from exactly one of ``uniform`` (an
  array) and ``seed`` (uint32 ``(2,)``), or None where neither is given and
  ``required`` is False.

  Raises:
    ValueError: both given, neither where ``required``, or a bad seed.
  """
  if uniform is not None and seed is not None:
    raise ValueError("pass either uniform random values or a seed, not both")
  if seed is not None:
    return dither.uniform_of_seed(check_seed(seed), n)
  if uniform is None:
    if required:
      raise ValueError("stochastic rounding needs uniform= or seed=")
    return None
  return uniform_f32(uniform).reshape(-1)


# ----------------------------------------------------------------------------
# Integer rounding with truncating conversions (the Mosaic and Triton kernels).
# ----------------------------------------------------------------------------


def floor_to_int(v: jax.Array) -> jax.Array:
  """floor(v) as int32 with only truncating conversion (no floor on Mosaic)."""
  t = v.astype(jnp.int32)
  return t - (t.astype(jnp.float32) > v).astype(jnp.int32)


def round_half_even_to_int(v: jax.Array) -> jax.Array:
  """int32 ``round(v)``, ties to even, with truncating conversions only
  (Pallas' Triton lowering has no ``lax.round``): ``v - floor(v)`` is exact
  for ``|v| < 2**23``; equal to ``jnp.round(v).astype(jnp.int32)`` there."""
  f = floor_to_int(v)
  d = v - f.astype(jnp.float32)
  up = (d > 0.5) | ((d == 0.5) & ((f & 1) == 1))
  return f + up.astype(jnp.int32)


# Input dtypes the kernels read in place (converted to float32 in registers).
IN_PLACE = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


# ----------------------------------------------------------------------------
# Dispatch by implementation (the ``*_auto`` functions).
# ----------------------------------------------------------------------------


def scratch_seed(x: jax.Array) -> tuple:
  """A seed for a scratch run of an op (autotuning)."""
  del x
  return (jnp.array([0x9E3779B9, 7], jnp.uint32),)


def scratch_uniform(x: jax.Array) -> tuple:
  """Uniform numbers for a scratch run of an op (autotuning)."""
  return (jax.random.uniform(jax.random.key(1), (x.size,), jnp.float32),)


def in_place(n: int, group: int, dtype) -> bool:
  """Whether the Pallas path reads ``x`` in place (whole (8, group) tiles
  of a float32 or 16-bit float), or pays a padding copy."""
  return n > 0 and n % (8 * group) == 0 and jnp.dtype(dtype) in IN_PLACE


def rounding_of(uniform, seed, *, required: bool) -> str:
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


def extras_of(rounding_: str) -> Callable[[jax.Array], tuple]:
  """The scratch operands a run with this rounding takes besides ``x``."""
  return {"seed": scratch_seed, "array": scratch_uniform}.get(
      rounding_, lambda x: ())


def split_rounding(rounding_: str, r: tuple):
  """``(uniform, seed)`` from a scratch run's extra operands."""
  return ((None, r[0]) if rounding_ == "seed"
          else (r[0], None) if rounding_ == "array" else (None, None))


def rounding_args(uniform, seed) -> tuple:
  """The operands after ``x`` of a run (:func:`split_rounding`'s inverse)."""
  return tuple(r for r in (uniform, seed) if r is not None)


def block_tunable(op: str, x, *, block_size, rounding: str, run, triton: bool,
                  **params):
  """The autotuning key and candidates of an int8 / fp8 block quantization
  (``triton``: whether the Triton kernel is a candidate)."""
  supported = block_size % ROW == 0
  return _autotune.Tunable(
      op=op, n=x.size, dtype=x.dtype, run=run, extras=extras_of(rounding),
      params={"block_size": block_size, "rounding": rounding,
              "in_place": in_place(x.size, block_size, x.dtype), **params},
      supported=supported,
      candidates=_autotune.candidates(mosaic=supported,
                                      triton=supported and triton))
