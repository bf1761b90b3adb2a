"""QSGD: stochastic quantization to s levels per bucket, bit-packed."""

from __future__ import annotations

import dataclasses
import math
import numbers
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxcomp.compressors.base import Compressor, register
from jaxcomp.kernels import bitpack


def code_bits(levels: int) -> int:
  """Bits per element on the wire: 1 sign bit + ceil(log2(levels + 1)),
  rounded up to a width that packs evenly into uint32 (2, 4, 8 or 16)."""
  need = 1 + math.ceil(math.log2(levels + 1))
  for bits in (2, 4, 8, 16):
    if need <= bits:
      return bits
  raise ValueError(f"levels must be at most 32767, got {levels=}")


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

  Args:
    levels: number of quantization levels s >= 1 (s = 1 is ternary).
    bucket_size: elements sharing one norm, >= 1.

  Raises:
    ValueError: ``levels`` < 1 or > 32767, ``bucket_size`` < 1.

  References:
    Alistarh et al., QSGD: Communication-Efficient SGD via Gradient
    Quantization and Encoding <https://arxiv.org/abs/1610.02132>, 2017.
  """

  name: ClassVar[str] = "qsgd"
  randomness: ClassVar[str] = "independent"
  levels: int = 4
  bucket_size: int = 512

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

  @property
  def bits(self) -> int:
    return code_bits(self.levels)

  def _buckets(self, n: int) -> int:
    return -(-n // self.bucket_size)

  def encode(self, x, key):
    n = x.shape[0]
    nb = self._buckets(n)
    xb = jnp.pad(x, (0, nb * self.bucket_size - n)).reshape(nb, -1)
    norms = jnp.sqrt(jnp.sum(xb * xb, axis=1))
    safe = jnp.where(norms > 0, norms, 1.0)
    u = jax.random.uniform(key, xb.shape, jnp.float32)
    level = jnp.floor(jnp.abs(xb) / safe[:, None] * self.levels + u)
    level = jnp.clip(level, 0, self.levels).astype(jnp.uint32)
    sign = (xb < 0).astype(jnp.uint32) << (self.bits - 1)
    codes = (sign | level).reshape(-1)[:n]
    return {"codes": bitpack.pack_bits_reference(codes, self.bits),
            "norms": norms}

  def decode(self, payload, n, key):
    del key
    codes = bitpack.unpack_bits_reference(payload["codes"], self.bits, n)
    level = (codes & jnp.uint32((1 << (self.bits - 1)) - 1)).astype(jnp.float32)
    sign = 1.0 - 2.0 * (codes >> (self.bits - 1)).astype(jnp.float32)
    nb = self._buckets(n)
    norm = jnp.repeat(payload["norms"], self.bucket_size,
                      total_repeat_length=nb * self.bucket_size)[:n]
    return sign * norm * level / self.levels

  def payload_bytes(self, n: int) -> int:
    return 4 * bitpack.packed_words(n, self.bits) + 4 * self._buckets(n)
