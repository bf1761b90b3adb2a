"""QSGD: stochastic quantization to s levels per bucket, bit-packed."""

from __future__ import annotations

import dataclasses
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxcomp.compressors.base import Compressor, check_implementation, register
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import quantize


# Bits per element on the wire: 1 sign bit + ceil(log2(levels + 1)), rounded
# up to 2, 4, 8 or 16 so that codes pack evenly into uint32 words.
code_bits = quantize.qsgd_bits


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
  (:mod:`jaxcomp.kernels.quantize`; both give the same words bit for bit);
  ``implementation=None`` takes the reference, measured faster on an H100.

  Args:
    levels: number of quantization levels s >= 1 (s = 1 is ternary).
    bucket_size: elements sharing one norm, >= 1 (a multiple of 32 for the
      Pallas kernel).
    implementation: ``"pallas"``, ``"xla"`` or None (measured-faster path).

  Raises:
    ValueError: ``levels`` < 1 or > 32767, ``bucket_size`` < 1, an unknown
      ``implementation``.

  References:
    Alistarh et al., QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>, 2017.
  """

  name: ClassVar[str] = "qsgd"
  randomness: ClassVar[str] = "independent"
  levels: int = 4
  bucket_size: int = 512
  implementation: str | None = None

  def __post_init__(self):
    for field in ("levels", "bucket_size"):
      v = getattr(self, field)
      if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise TypeError(f"{field} must be an integer, got {field}={v!r}")
    if self.levels < 1:
      raise ValueError(f"levels must be >= 1, got levels={self.levels}")
    if self.bucket_size < 1:
      raise ValueError(
          f"bucket_size must be >= 1, got bucket_size={self.bucket_size}")
    code_bits(self.levels)
    check_implementation(self.implementation)

  @property
  def bits(self) -> int:
    return code_bits(self.levels)

  def _buckets(self, n: int) -> int:
    return -(-n // self.bucket_size)

  def encode(self, x, key):
    u = jax.random.uniform(key, x.shape, jnp.float32)
    codes, norms = quantize.qsgd_quantize_auto(
        x, u, levels=self.levels, bucket_size=self.bucket_size,
        implementation=self.implementation)
    return {"codes": codes, "norms": norms}

  def decode(self, payload, n, key):
    del key
    return quantize.qsgd_dequantize_reference(
        payload["codes"], payload["norms"], n=n, levels=self.levels,
        bucket_size=self.bucket_size)

  def payload_bytes(self, n: int) -> int:
    return 4 * bitpack.packed_words(n, self.bits) + 4 * self._buckets(n)
