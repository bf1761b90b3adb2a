"""Sparse payloads: (value, index) pairs decoded by scatter-add, and the
exact top-k among the entries a threshold lets through."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors.base import Compressor


def scatter_decode(payload, n: int) -> jax.Array:
  """float32 ``(n,)``: the payload's values scatter-added at its indices."""
  return jnp.zeros((n,), jnp.float32).at[payload["indices"]].add(
      payload["values"].astype(jnp.float32))


def scatter_decode_sum(payloads, n: int) -> jax.Array:
  """Sum of stacked payloads (leading axis: devices) in one scatter-add."""
  return jnp.zeros((n,), jnp.float32).at[payloads["indices"].reshape(-1)].add(
      payloads["values"].reshape(-1).astype(jnp.float32))


def largest_eligible(x: jax.Array, eligible: jax.Array, cap: int):
  """The ``cap`` largest ``|x|`` among ``eligible`` entries, by ``lax.top_k``
  over all of ``x`` in descending ``|x|``: the exact fallback of the
  threshold selections, for the steps on which more entries pass than their
  candidate capacity holds.

  Returns:
    ``(values (cap,) in x.dtype, indices int32 (cap,))``; slots beyond the
    number of eligible entries hold value 0.
  """
  score = jnp.where(eligible, jnp.abs(x).astype(jnp.float32), -1.0)
  top, idx = lax.top_k(score, cap)
  return jnp.where(top >= 0, x[idx], 0), idx.astype(jnp.int32)


class SparsePayload(Compressor):
  """Base of the compressors whose payload is ``capacity(n)`` (value, index)
  pairs: ``values`` (in the gradient's dtype) and ``indices`` int32, decoded
  by scatter-add (one scatter-add for all devices' payloads in
  :meth:`decode_sum`). Subclasses define ``encode`` and ``capacity``."""

  def capacity(self, n: int) -> int:
    raise NotImplementedError

  def decode(self, payload, n, key):
    del key
    return scatter_decode(payload, n)

  def decode_sum(self, payloads, n, key):
    """Sum of stacked payloads (leading axis = devices) in one scatter-add."""
    del key
    return scatter_decode_sum(payloads, n)

  def payload_bytes(self, n: int) -> int:
    return 8 * self.capacity(n)
