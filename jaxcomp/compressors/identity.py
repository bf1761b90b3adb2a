"""Identity and cast compressors: dense payloads that psum can carry."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from jaxcomp.compressors.base import Compressor, register


@register
@dataclasses.dataclass(frozen=True)
class Identity(Compressor):
  """No compression: the float32 gradient itself (the exact ``pmean`` baseline).

  Payload: float32 ``(n,)``, ``4 * n`` bytes.
  """

  name: ClassVar[str] = "identity"
  max_elements: ClassVar[None] = None  # addresses no element
  linear: ClassVar[bool] = True
  dense: ClassVar[bool] = True

  def encode(self, x, key):
    del key
    return x

  def decode(self, payload, n, key):
    del n, key
    return payload

  def payload_bytes(self, n: int) -> int:
    return 4 * n


_CAST_DTYPES = {
    "float32": jnp.float32,
    "bfloat16": jnp.bfloat16,
    "float16": jnp.float16,
}


@register
@dataclasses.dataclass(frozen=True)
class Cast(Compressor):
  """Casts the gradient to a narrower float type for the all-reduce.

  The all-reduce then sums in that type, as PyTorch DDP's ``fp16_compress_hook``
  and ``bf16_compress_hook`` do. For float16, each device divides by the number
  of devices *before* the cast (``prescale``), like the fp16 hook, so that the
  sum stays within float16's range (max 65504).

  Payload: ``(n,)`` of ``dtype``: ``2 * n`` bytes for 16-bit types.

  Args:
    dtype: ``"bfloat16"``, ``"float16"`` or ``"float32"`` (an exact, 1x "cast").

  Raises:
    ValueError: unsupported ``dtype``.
  """

  name: ClassVar[str] = "cast"
  max_elements: ClassVar[None] = None  # addresses no element
  linear: ClassVar[bool] = True
  dense: ClassVar[bool] = True
  dtype: str = "bfloat16"

  def __post_init__(self):
    if not isinstance(self.dtype, str) or self.dtype not in _CAST_DTYPES:
      raise ValueError(
          f"dtype must be one of {sorted(_CAST_DTYPES)}, got dtype={self.dtype!r}")

  @property
  def prescale(self) -> bool:
    return self.dtype == "float16"

  def encode(self, x, key):
    del key
    return x.astype(_CAST_DTYPES[self.dtype])

  def decode(self, payload, n, key):
    del n, key
    return payload.astype(jnp.float32)

  def payload_bytes(self, n: int) -> int:
    return jnp.dtype(_CAST_DTYPES[self.dtype]).itemsize * n


@register
@dataclasses.dataclass(frozen=True)
class BF16(Cast):
  """bfloat16 cast (see :class:`Cast`); 2 bytes per element."""

  name: ClassVar[str] = "bf16"
  dtype: str = dataclasses.field(default="bfloat16", init=False)


@register
@dataclasses.dataclass(frozen=True)
class FP16(Cast):
  """float16 cast with pre-division by the device count (see :class:`Cast`)."""

  name: ClassVar[str] = "fp16"
  dtype: str = dataclasses.field(default="float16", init=False)
