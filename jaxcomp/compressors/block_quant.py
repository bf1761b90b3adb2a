"""Block quantization: integer (int8, int4, int2) and fp8 (e4m3 / e5m2), one
float32 scale per block."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, check_implementation, register
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import dither
from jaxcomp import kernels
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block

INT_BITS = (2, 4, 8)
ROUNDINGS = ("nearest", "stochastic")
# name: (dtype, largest finite value), from the kernels' table.
FP8_FORMATS = {name: (f[4], f[2]) for name, f in fp8_block.FP8_FORMATS.items()}


def _check_block(block_size) -> None:
  if isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
    raise TypeError(f"block_size must be an integer, got {block_size=!r}")
  if block_size < 1:
    raise ValueError(f"block_size must be >= 1, got {block_size=}")


def _check_rounding(rounding) -> None:
  if rounding not in ROUNDINGS:
    raise ValueError(f"rounding must be one of {ROUNDINGS}, got {rounding=!r}")


class _Rounded(Compressor):
  """Randomness and bias follow the ``rounding`` field: stochastic rounding
  draws per-device bits and is unbiased; nearest rounding is biased. Dense
  payloads that can be re-encoded after a reduction: two-phase where it
  moves fewer bytes (``"auto"``)."""

  default_collective: ClassVar[str] = "auto"
  rounding: str  # the subclasses' field

  @property
  def randomness(self):
    return "independent" if self.rounding == "stochastic" else "none"

  @property
  def biased(self):
    return self.rounding == "nearest"


def _scales(x: jax.Array, block_size: int, top) -> jax.Array:
  """float32 ``(ceil(n / block_size),)``: ``max|x|`` of each block (the last
  one partial) over ``top``, read in place (no padded copy)."""
  return kernels.group_reduce(x.astype(jnp.float32), block_size, "max",
                               jnp.abs) / top


@register
@dataclasses.dataclass(frozen=True)
class IntBlock(_Rounded):
  """Integer block quantization (int8 by default), one scale per block.

  The buffer is cut into blocks of ``block_size`` elements (the last block
  may be partial: ``block_size`` need not divide ``n``). Per block,
  ``scale = max|x| / L`` with ``L = 2**(bits - 1) - 1`` (127 for 8 bits) and
  ``q = round(x / scale)`` (``rounding="nearest"``, half to even) or
  ``floor(x / scale + u)``, ``u ~ U[0, 1)`` independent per device
  (``"stochastic"``: unbiased), clipped to ``[-L, L]``; ``q = 0`` in a block
  of zeros. Decode: ``q * scale``. Error per element: at most ``scale / 2``
  (nearest) or ``scale`` (stochastic); values already on the grid
  (``x = q * scale``) are reproduced exactly by nearest rounding.

  Codes travel as ``bits``-bit two's complement fields packed into uint32
  words (:mod:`jaxcomp.kernels.bitpack`; for 8 bits the words hold the same
  bytes as an int8 array). Not linear (scales differ per device):
  all-gathered.

  Payload: ``codes`` uint32 ``(ceil(n * w / 32),)`` with ``w = max_bits or
  bits`` and ``scales`` float32 ``(ceil(n / block_size),)``.

  Scheduling ``bits`` (``optax.inject_hyperparams``): pass ``max_bits`` (the
  wire width, static); the traced ``bits <= max_bits`` sets ``L``.

  Args:
    bits: bits per element, one of 2, 4, 8.
    block_size: elements per scale, >= 1.
    rounding: ``"nearest"`` or ``"stochastic"``.
    max_bits: wire width when ``bits`` is scheduled (one of 2, 4, 8), or None.
    implementation: for 8 bits, ``"pallas"`` (the int8 block kernel of
      :mod:`jaxcomp.kernels.int8_block`; ``block_size`` a multiple of 32),
      ``"xla"`` (its reference), or None (XLA off NVIDIA GPUs, the path
      measured faster on one: :class:`jaxcomp.kernels.Autotuner`).

  Raises:
    ValueError: ``bits``/``max_bits`` outside (2, 4, 8), ``bits > max_bits``,
      ``block_size`` < 1, unknown ``rounding`` or ``implementation``.
    TypeError: non-integer ``block_size``.

  References:
    Dettmers, 8-Bit Approximations for Parallelism in Deep Learning
    <https://arxiv.org/abs/1511.04561>, 2016; Dettmers et al., 8-bit
    Optimizers via Block-wise Quantization <https://arxiv.org/abs/2110.02861>,
    2022 (block-wise scales).
  """

  name: ClassVar[str] = "int8_block"
  bits: int = 8
  block_size: int = 256
  rounding: str = "nearest"
  max_bits: int | None = None
  implementation: str | None = None

  def __post_init__(self):
    _check_block(self.block_size)
    _check_rounding(self.rounding)
    check_implementation(self.implementation)
    for field in ("bits", "max_bits"):
      c = _hparams.concrete(getattr(self, field), field)
      if c is not None and c not in INT_BITS:
        raise ValueError(f"{field} must be one of {INT_BITS}, got {field}={c}")
    _hparams.capacity(self.bits, self.max_bits, "bits", "max_bits")

  @property
  def wire_bits(self) -> int:
    return int(_hparams.capacity(self.bits, self.max_bits, "bits", "max_bits"))

  def _levels(self) -> jax.Array:
    c = _hparams.concrete(self.bits)
    if c is not None:
      return jnp.float32(2 ** (int(c) - 1) - 1)
    return jnp.exp2(_hparams.as_f32(self.bits) - 1.0) - 1.0

  def quantize(self, x, key):
    """``(q float32 (n,), scales float32 (ceil(n / block_size),))``."""
    n = x.shape[0]
    levels = self._levels()
    scales = _scales(x, self.block_size, levels)
    y = x.astype(jnp.float32) / kernels.per_element(
        jnp.where(scales > 0, scales, 1.0), self.block_size, n)
    if self.rounding == "stochastic":
      q = jnp.floor(y + dither.uniform(key, n))
    else:
      q = jnp.round(y)
    return jnp.clip(q, -levels, levels), scales

  def encode(self, x, key):
    n = x.shape[0]
    if _hparams.concrete(self.bits) == 8 and self.wire_bits == 8:
      # 8 bits: the int8 block kernel or its jnp reference quantizes (by
      # implementation); same codes on the wire. Stochastic rounding draws
      # dither.uniform(key, n) from the seed where it is used (inside the
      # kernel on the Pallas path: no n-sized random array).
      seed = dither.seed_of(key) if self.rounding == "stochastic" else None
      q8, scales = int8_block.int8_block_quantize_auto(
          x, block_size=self.block_size, seed=seed,
          implementation=self.implementation)
      if self.block_size % 4 == 0:
        # The int8 bytes are the packed 8-bit words already (little-endian
        # bytes, as bitpack has them): a free bitcast instead of a repack.
        words = lax.bitcast_convert_type(q8.reshape(-1, 4), jnp.uint32)
        return {"codes": words[:bitpack.packed_words(n, 8)],
                "scales": scales}
      codes = q8[:n].astype(jnp.int32).astype(jnp.uint32)
    else:
      q, scales = self.quantize(x, key)
      codes = q.astype(jnp.int32).astype(jnp.uint32)
    return {"codes": bitpack.pack_bits_reference(codes, self.wire_bits),
            "scales": scales}

  def decode(self, payload, n, key):
    del key
    w = self.wire_bits
    c = bitpack.unpack_bits_reference(payload["codes"], w, n)
    shift = jnp.int32(32 - w)  # sign-extend the w-bit field
    q = lax.shift_right_arithmetic(
        lax.shift_left(c.astype(jnp.int32), shift), shift)
    return q.astype(jnp.float32) * kernels.per_element(
        payload["scales"], self.block_size, n)

  def payload_arrays(self, n: int, dtype=jnp.float32) -> tuple[int, ...]:
    """By formula for float32 buffers, in the payload's tree order (what
    tracing ``encode`` gives, tested; the performance model prices
    thousands of bucket sizes and a trace costs some 40 ms): ``codes``
    (uint32 words) and ``scales`` (float32); :meth:`payload_bytes` is their sum."""
    if jnp.dtype(dtype) != jnp.float32:
      return super().payload_arrays(n, dtype)
    n = int(n)
    return (4 * bitpack.packed_words(n, self.wire_bits), 4 * (-(-n // self.block_size)))


@register
@dataclasses.dataclass(frozen=True)
class FP8Block(_Rounded):
  """fp8 block quantization (e4m3 or e5m2), one float32 scale per block.

  Per block of ``block_size`` elements (the last one may be partial),
  ``scale = max|x| / F`` with ``F`` the format's largest finite value (448 for
  e4m3 = ``float8_e4m3fn``, 57344 for e5m2), and each element is
  ``x * (1 / scale)`` cast to fp8: round to nearest even (``"nearest"``), or
  ``"stochastic"``: rounded to one of its two fp8 neighbours with
  probabilities that make it unbiased (independent per device). Relative
  error of nearest rounding: at most ``2**-4`` (e4m3) / ``2**-3`` (e5m2) of
  the value for normal numbers, plus the subnormal spacing times ``scale``.

  The fp8 bytes travel bit-cast to uint8 (all-gathered: the scales differ
  per device).

  Payload: ``values`` uint8 ``(n,)`` and ``scales`` float32
  ``(ceil(n / block_size),)``: ``n + 4 * ceil(n / block_size)`` bytes.

  Args:
    format: ``"e4m3"`` or ``"e5m2"``.
    block_size: elements per scale, >= 1.
    rounding: ``"nearest"`` or ``"stochastic"``.
    implementation: ``"pallas"`` (the one-pass fp8 block kernel of
      :mod:`jaxcomp.kernels.fp8_block`; ``block_size`` a multiple of 32),
      ``"xla"`` (its reference, the same codes bit for bit), or None (XLA
      off NVIDIA GPUs, the path measured faster on one:
      :class:`jaxcomp.kernels.Autotuner`).

  Raises:
    ValueError: unknown ``format``, ``rounding`` or ``implementation``,
      ``block_size`` < 1.

  References:
    Micikevicius et al., FP8 Formats for Deep Learning
    <https://arxiv.org/abs/2209.05433>, 2022.
  """

  name: ClassVar[str] = "fp8_block"
  format: str = "e4m3"
  block_size: int = 256
  rounding: str = "nearest"
  implementation: str | None = None

  def __post_init__(self):
    if not isinstance(self.format, str) or self.format not in FP8_FORMATS:
      raise ValueError(
          f"format must be one of {sorted(FP8_FORMATS)}, got {self.format=!r}")
    _check_block(self.block_size)
    _check_rounding(self.rounding)
    check_implementation(self.implementation)

  def encode(self, x, key):
    # The fp8 block kernel or its XLA reference (by implementation): the
    # same codes; stochastic rounding draws dither.uniform(key, n) from the
    # seed (inside the kernel on the Pallas path).
    seed = dither.seed_of(key) if self.rounding == "stochastic" else None
    bits, scales = fp8_block.fp8_block_quantize_auto(
        x, block_size=self.block_size, format=self.format, seed=seed,
        implementation=self.implementation)
    return {"values": bits, "scales": scales}

  def decode(self, payload, n, key):
    # From the codes' bits, not XLA's fp8 -> float32 conversion: a device
    # decoding its own payload (error feedback's local decode) holds the
    # encoder's float32 -> fp8 conversion in the same program, and XLA on a
    # GPU folds that round trip into the unrounded value.
    del key
    return fp8_block.fp8_block_dequantize_reference(
        payload["values"], payload["scales"], block_size=self.block_size,
        n=n, format=self.format)

  def payload_bytes(self, n: int) -> int:
    return n + 4 * (-(-n // self.block_size))
