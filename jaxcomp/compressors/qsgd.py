"""QSGD: stochastic quantization to s levels per bucket, bit-packed."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar, cast

import jax.numpy as jnp

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, check_implementation, register
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import dither
from jaxcomp.kernels import qsgd as qsgd_kernel


# Bits per element on the wire: 1 sign bit + ceil(log2(levels + 1)), rounded
# up to 2, 4, 8 or 16 so that codes pack evenly into uint32 words.
code_bits = qsgd_kernel.qsgd_bits


@register
@dataclasses.dataclass(frozen=True)
class QSGD(Compressor):
  """QSGD quantization (Alistarh et al. 2017), unbiased.

  The buffer is cut into buckets of ``bucket_size`` elements (the last one
  zero-padded). Per bucket, with ``norm = ||x_b||_2``, every element becomes
  ``sign(x) * norm * l / s`` where ``l = floor(|x| / norm * s + u)``,
  ``u ~ U[0, 1)`` drawn independently on each device, so
  ``E[Q(x)] = x`` and ``E||Q(x) - x||^2 <= min(d / s^2, sqrt(d) / s) ||x||^2``
  for bucket size ``d`` (the paper's Lemma 3.1).

  Each element's code is its level in the low bits and its sign in the top bit
  of a ``code_bits(levels)``-bit field (4 bits for ``levels`` <= 7), packed
  into uint32 words with :mod:`jaxcomp.kernels.bitpack`.

  Payload: ``codes`` uint32 ``(ceil(n * bits / 32),)`` and ``norms`` float32
  ``(ceil(n / bucket_size),)``.

  Encoding runs the Pallas quantize-and-pack kernel or its ``jnp`` reference
  (:mod:`jaxcomp.kernels.qsgd`; the same words given the same norms,
  and the kernel's norms within a few float32 ulp of the reference's);
  ``implementation=None`` takes the reference off NVIDIA GPUs and, on one,
  the path measured faster there for this size and bucket
  (:func:`jaxcomp.kernels.autotune`).

  ``levels`` may follow a schedule (``optax.inject_hyperparams``) with
  ``max_levels`` as the static maximum: the code width is then
  ``code_bits(max_levels)`` at every step (the payload's shape cannot
  change), the traced ``levels`` is floored and clipped to
  ``[1, max_levels]``, and encoding takes the ``jnp`` reference.

  Args:
    levels: number of quantization levels s >= 1 (s = 1 is ternary); may be
      traced when ``max_levels`` is set. The default, 7, is the most that
      4-bit codes hold.
    bucket_size: elements sharing one norm, >= 1 (a multiple of 32 for the
      Pallas kernel); default 128.
    implementation: ``"pallas"``, ``"xla"`` or None (XLA off NVIDIA GPUs,
      the path measured faster on one: :class:`jaxcomp.kernels.Autotuner`).
    max_levels: static maximum of a scheduled ``levels``, or None.

  Raises:
    TypeError: ``levels``, ``max_levels`` or ``bucket_size`` not an integer.
    ValueError: ``levels`` < 1 or > 32767, ``levels > max_levels``, a traced
      ``levels`` without ``max_levels``, ``bucket_size`` < 1, an unknown
      ``implementation``.

  References:
    Alistarh et al., QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>, 2017.
  """

  name: ClassVar[str] = "qsgd"
  randomness: ClassVar[str] = "independent"
  default_collective: ClassVar[str] = "auto"  # two-phase where it pays
  # Defaults: 7 levels fill the 4-bit codes that 4 levels already pay for,
  # and 128-element buckets cost 3% more bytes than 512 but cut the
  # variance bound; on digits (benchmarks/defaults.py --steps 200) levels=4
  # reached 0.566 test accuracy, levels=7 0.909 and levels=7 with buckets
  # of 128 0.967, against 0.969 uncompressed.
  levels: int = 7
  bucket_size: int = 128
  implementation: str | None = None
  max_levels: int | None = None

  def __post_init__(self):
    v = self.bucket_size
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
      raise TypeError(f"bucket_size must be an integer, got bucket_size={v!r}")
    if self.bucket_size < 1:
      raise ValueError(
          f"bucket_size must be >= 1, got bucket_size={self.bucket_size}")
    _hparams.check_number(self.levels, "levels", low=1, high=2**15 - 1,
                          integer=True)
    if self.max_levels is not None:
      _hparams.check_number(self.max_levels, "max_levels", low=1,
                            high=2**15 - 1, integer=True)
    _ = self.bits  # raises: levels > max_levels, or traced without max_levels
    check_implementation(self.implementation)

  @property
  def bits(self) -> int:
    """Code width on the wire (of ``max_levels`` when it is set)."""
    return code_bits(int(_hparams.capacity(self.levels, self.max_levels,
                                           "levels", "max_levels")))

  def _levels(self):
    """Concrete ``int`` levels, or the traced levels as float32 within
    ``[1, max_levels]``."""
    c = _hparams.concrete(self.levels)
    if c is not None:
      return int(c)
    # __post_init__ (self.bits) rejects traced levels without max_levels.
    return jnp.clip(jnp.floor(_hparams.as_f32(self.levels)), 1.0,
                    float(cast(int, self.max_levels)))

  def _buckets(self, n: int) -> int:
    return -(-n // self.bucket_size)

  def encode(self, x, key):
    # The rounding numbers are dither.uniform(key, n), drawn from the seed
    # where they are used: in XLA's fused expression, or inside the kernel
    # (no n-sized random array on the Pallas path).
    seed = dither.seed_of(key)
    levels = self._levels()
    if isinstance(levels, int) and self.bits == code_bits(levels):
      codes, norms = qsgd_kernel.qsgd_quantize_auto(
          x, levels=levels, bucket_size=self.bucket_size, seed=seed,
          implementation=self.implementation)
    else:  # scheduled levels: the reference, with max_levels' code width
      codes, norms = qsgd_kernel.qsgd_quantize_reference(
          x, levels=levels, bucket_size=self.bucket_size, bits=self.bits,
          seed=seed)
    return {"codes": codes, "norms": norms}

  def decode(self, payload, n, key):
    del key
    return qsgd_kernel.qsgd_dequantize_reference(
        payload["codes"], payload["norms"], n=n, levels=self._levels(),
        bucket_size=self.bucket_size, bits=self.bits)

  def payload_arrays(self, n: int, dtype=jnp.float32) -> tuple[int, ...]:
    """By formula for float32 buffers, in the payload's tree order (what
    tracing ``encode`` gives, tested; the performance model prices
    thousands of bucket sizes and a trace costs some 100 ms): ``codes``
    (uint32 words) and ``norms`` (float32); :meth:`payload_bytes` is their sum."""
    if jnp.dtype(dtype) != jnp.float32:
      return super().payload_arrays(n, dtype)
    n = int(n)
    return (4 * bitpack.packed_words(n, self.bits), 4 * self._buckets(n))
