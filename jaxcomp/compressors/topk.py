"""Top-k sparsification by magnitude."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import check_implementation, ratio_slots, register
from jaxcomp.compressors.sparse import SparsePayload
from jaxcomp.kernels import bitpack
from jaxcomp.kernels import topk as topk_kernels


@register
@dataclasses.dataclass(frozen=True)
class TopK(SparsePayload):
  """Sends the k = ceil(ratio * n) entries of largest magnitude.

  Exact selection: the same set as ``lax.top_k`` of ``|x|`` (ties go to the
  lower index). What runs with ``implementation=None`` off NVIDIA GPUs (and
  on one where it measures faster: :class:`jaxcomp.kernels.Autotuner`) is
  the XLA path (:func:`jaxcomp.kernels.topk.topk_auto`): ``lax.top_k`` and an
  index sort below :func:`jaxcomp.kernels.topk.fast_path_min_size` elements
  (2^19 on CPU, 2^22 on GPU), and from there the sampled-threshold fast path
  (a threshold bracket from an evenly spaced sample, bit-mask compaction of
  the candidates, an exact sort of the bracket only). The Pallas path (the
  same selection with its one pass over ``x`` in a mask kernel, a radix
  select only when the sample misleads) runs with
  ``implementation="pallas"``, or with None on an NVIDIA GPU where it
  measures faster (its earlier radix-select version was slower than the XLA
  path on an H100 at every size measured). Biased, so
  :func:`jaxcomp.compressed_mean` turns residual error feedback on by
  default. Not linear: the payloads are all-gathered and every device
  scatter-adds all of them.

  Payload: ``values`` ``(k,)`` in the gradient's dtype and ``indices`` int32
  ``(k,)``: ``8 * k`` bytes for float32 (``6 * k`` for bfloat16). With
  ``value_bits=b`` the values travel as ``b``-bit sign-magnitude codes with
  one float32 step (:func:`quantize_values`): ``4 k + 4 ceil(k b / 32) + 4``
  bytes, 2-bit values cutting top-k's payload to 53%. This is SparseLoCo's
  top-k with 2-bit values and error feedback (Sarfi, Thérien, Lidin &
  Belilovsky, Communication Efficient LLM Pre-training with SparseLoCo
  <https://arxiv.org/abs/2508.15706>, 2025), whose quantizer sets its range
  from the values' spread; here the levels reach the largest value sent. With
  ``max_ratio`` (a scheduled ``ratio``), the payload always has ``k_max =
  ceil(max_ratio * n)`` slots and the entries beyond the ``ceil(ratio * n)``
  largest are sent as zeros.

  Args:
    ratio: fraction of entries sent, in (0, 1]; may be traced (a schedule
      under ``optax.inject_hyperparams``) when ``max_ratio`` is set.
    max_ratio: static capacity for a scheduled ``ratio``, or None.
    value_bits: 2, 4 or 8 to quantize the sent values, or None.
    implementation: ``"pallas"`` (one mask kernel), ``"xla"`` or None
      (the XLA path on every backend, measured faster on an H100; see
      :func:`jaxcomp.kernels.topk.topk_auto`).

  Raises:
    ValueError: ``ratio`` or ``max_ratio`` outside (0, 1], ``ratio >
      max_ratio``, a traced ``ratio`` without ``max_ratio``, an unknown
      ``implementation``, ``value_bits`` not in (2, 4, 8), or ``value_bits``
      with ``max_ratio``.

  References:
    Aji & Heafield, Sparse Communication for Distributed Gradient Descent
    <https://arxiv.org/abs/1704.05021>, 2017; Stich et al., Sparsified SGD
    with Memory <https://arxiv.org/abs/1809.07599>, 2018.
  """

  name: ClassVar[str] = "topk"
  biased: ClassVar[bool] = True
  ratio: float = 0.01
  max_ratio: float | None = None
  implementation: str | None = None
  value_bits: int | None = None

  def __post_init__(self):
    _hparams.check_ratio_capacity(self.ratio, self.max_ratio)
    check_implementation(self.implementation)
    if self.value_bits is not None:
      if self.value_bits not in VALUE_BITS:
        raise ValueError(f"value_bits must be one of {VALUE_BITS} or None, "
                         f"got value_bits={self.value_bits!r}")
      if self.max_ratio is not None:
        raise ValueError(
            "value_bits with max_ratio is not supported: the zeroed slots of "
            "a scheduled ratio have no code. Fix the ratio, or leave "
            "value_bits=None")

  def k(self, n: int) -> int:
    """Payload slots: ``ceil(ratio * n)``, or the capacity with max_ratio."""
    return ratio_slots(self.ratio, self.max_ratio, n)

  def capacity(self, n: int) -> int:
    """Payload slots (:class:`SparsePayload`): :meth:`k`."""
    return self.k(n)

  def encode(self, x, key):
    del key
    n, k = x.shape[0], self.k(x.shape[0])
    values, idx = topk_kernels.topk_auto(x, k,
                                         implementation=self.implementation)
    if self.max_ratio is not None:
      # Keep the ceil(ratio * n) largest of the k_max selected, zero the rest.
      k_now = _hparams.ceil_count(self.ratio, n, k)
      _, order = lax.top_k(jnp.abs(values), k)
      rank = jnp.zeros((k,), jnp.int32).at[order].set(
          jnp.arange(k, dtype=jnp.int32))
      values = jnp.where(rank < k_now, values, jnp.zeros_like(values))
    if self.value_bits is not None:
      return {**quantize_values(values, self.value_bits),
              "indices": idx.astype(jnp.int32)}
    return {"values": values, "indices": idx.astype(jnp.int32)}

  def values(self, payload):
    if self.value_bits is None:
      return super().values(payload)
    return dequantize_values(payload, self.value_bits,
                             payload["indices"].shape[-1])

  def payload_bytes(self, n: int) -> int:
    if self.value_bits is None:
      return super().payload_bytes(n)
    k = self.k(n)
    return 4 * k + 4 * bitpack.packed_words(k, self.value_bits) + 4

  def payload_arrays(self, n: int, dtype=jnp.float32) -> tuple[int, ...]:
    """By formula, in the payload's tree order (what tracing ``encode``
    gives, tested; the performance model prices thousands of bucket sizes
    and tracing the selection costs 0.5 s each): ``indices`` int32 and
    ``values`` in ``dtype``; with ``value_bits``, ``codes``, ``indices`` and
    ``scale``."""
    k = self.k(int(n))
    if self.value_bits is None:
      return (4 * k, k * jnp.dtype(dtype).itemsize)
    return (4 * bitpack.packed_words(k, self.value_bits), 4 * k, 4)


VALUE_BITS = (2, 4, 8)


def quantize_values(values: jax.Array, bits: int) -> dict:
  """Sign-magnitude codes of ``values`` (``(k,)``) on ``2**(bits - 1)``
  magnitude levels without zero, ``(m + 1/2) * step`` with ``step =
  max|values| / 2**(bits - 1)``, rounded to the nearest level (error at most
  ``step / 2``; biased, so residual error feedback keeps the rest). Top-k
  values are the largest of the bucket, so no level is spent on zero.

  Returns:
    ``{"codes": uint32 (ceil(k bits / 32),), "scale": float32 (1,)}``, the
    codes packed with :mod:`jaxcomp.kernels.bitpack` and ``scale = step``.
  """
  levels = 2 ** (bits - 1)
  v = values.astype(jnp.float32)
  step = jnp.max(jnp.abs(v), initial=0.0) / levels
  inv = jnp.where(step > 0, 1.0 / jnp.where(step > 0, step, 1.0), 0.0)
  mag = jnp.clip(jnp.floor(jnp.abs(v) * inv), 0, levels - 1).astype(jnp.uint32)
  codes = mag | ((v < 0).astype(jnp.uint32) << (bits - 1))
  return {"codes": bitpack.pack_bits_reference(codes, bits),
          "scale": step.reshape(1)}


def dequantize_values(payload: dict, bits: int, k: int) -> jax.Array:
  """float32 values of :func:`quantize_values`' codes (any leading axes)."""
  words, scale = payload["codes"], payload["scale"]
  if words.ndim > 1:
    return jax.vmap(lambda w, s: dequantize_values(
        {"codes": w, "scale": s}, bits, k))(words, scale)
  c = bitpack.unpack_bits_reference(words, bits, k)
  mag = (c & jnp.uint32(2 ** (bits - 1) - 1)).astype(jnp.float32) + 0.5
  sign = 1.0 - 2.0 * (c >> (bits - 1)).astype(jnp.float32)
  return jnp.where(scale[0] > 0, sign * mag * scale[0], 0.0)
