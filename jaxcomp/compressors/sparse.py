"""Sparse payloads: (value, index) pairs decoded by scatter-add
(:class:`jaxcomp._parts.SparseParts`, whole bucket or per tensor), and the
exact top-k among the entries a threshold lets through."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxcomp import _parts
from jaxcomp.compressors.base import Compressor
from jaxcomp.kernels import topk as topk_kernels


def largest_eligible(x: jax.Array, eligible: jax.Array, cap: int):
  """The ``cap`` largest ``|x|`` among ``eligible`` entries: the exact
  fallback of the threshold selections, for the steps on which more entries
  pass than their candidate capacity holds. The non-eligible entries are
  zeroed and the top-k of what is left is taken by
  :func:`jaxcomp.kernels.topk.topk_auto` (its sampled-threshold path on big
  buffers: ``lax.top_k`` over all of ``x`` costs 17 to 19 ms at n = 1.86M
  on one CPU core, ``python benchmarks/topk_breakdown.py``, three times the
  dense MLP step of ``benchmarks/transform_overhead.py``).

  Returns:
    ``(values (cap,) in x.dtype, indices int32 (cap,))``, ascending index;
    slots beyond the number of eligible entries hold value 0.
  """
  values, idx = topk_kernels.topk_auto(jnp.where(eligible, x, 0), cap)
  return values, idx.astype(jnp.int32)


class SparsePayload(Compressor):
  """Base of the compressors whose payload is ``capacity(n)`` (value, index)
  pairs: ``values`` (in the gradient's dtype) and ``indices`` int32, decoded
  by scatter-add (one scatter-add for all devices' payloads in
  :meth:`decode_sum`). Subclasses define ``encode`` and ``capacity``."""

  def capacity(self, n: int) -> int:
    raise NotImplementedError

  def values(self, payload) -> jax.Array:
    """float32 values of a payload (any leading axes): ``payload["values"]``
    by default; compressors that quantize their values decode them here."""
    return payload["values"].astype(jnp.float32)

  def decode(self, payload, n, key):
    """float32 ``(n,)``: the values scatter-added at their indices."""
    return self.decode_parts(payload, (n,), key).dense()[0]

  def decode_sum(self, payloads, n, key):
    """Sum of stacked payloads (leading axis = devices) in one scatter-add."""
    return self.decode_sum_parts(payloads, (n,), key)[0]

  def decode_parts(self, payload, part_sizes, key):
    """This device's payload as sparse parts (see
    :class:`jaxcomp._parts.SparseParts`)."""
    del key
    return _parts.SparseParts(payload["indices"], self.values(payload),
                              part_sizes)

  def decode_sum_parts(self, payloads, part_sizes, key):
    """The stacked payloads scatter-added into each part's own zeros."""
    del key
    return _parts.SparseParts(payloads["indices"], self.values(payloads),
                              part_sizes).dense()

  def decode_sender_mean(self, payloads, n, key):
    """Each coordinate's sum over the devices that sent it, divided by how
    many did (0 where none did); a slot holding 0 counts as not sent (the
    unused capacity of threshold selections holds 0)."""
    del key
    idx = payloads["indices"].reshape(-1)
    total = jnp.zeros((n,), jnp.float32).at[idx].add(
        self.values(payloads).reshape(-1))
    count = jnp.zeros((n,), jnp.float32).at[idx].add(
        (self.values(payloads) != 0).astype(jnp.float32).reshape(-1))
    return total / jnp.maximum(count, 1.0)

  def payload_bytes(self, n: int) -> int:
    return 8 * self.capacity(n)
