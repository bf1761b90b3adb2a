"""Threshold sparsification: send the entries with |x| >= threshold, up to a
fixed capacity."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import (Compressor, check_ratio, num_selected,
                                      register)


def masked_topk(x: jax.Array, eligible: jax.Array, cap: int):
  """The ``cap`` largest ``|x|`` among ``eligible`` entries.

  Returns ``(values float32 (cap,), indices int32 (cap,))``; slots beyond the
  number of eligible entries hold value 0 (their index is arbitrary, so a
  scatter-add decode is unaffected).
  """
  score = jnp.where(eligible, jnp.abs(x), -1.0)
  top, idx = lax.top_k(score, cap)
  values = jnp.where(top >= 0, x[idx], 0.0)
  return values, idx.astype(jnp.int32)


def scatter_decode(payload, n: int) -> jax.Array:
  """float32 ``(n,)``: the payload's values scatter-added at its indices."""
  return jnp.zeros((n,), jnp.float32).at[payload["indices"]].add(
      payload["values"].astype(jnp.float32))


def scatter_decode_sum(payloads, n: int) -> jax.Array:
  """Sum of stacked payloads (leading axis: devices) in one scatter-add."""
  return jnp.zeros((n,), jnp.float32).at[payloads["indices"].reshape(-1)].add(
      payloads["values"].reshape(-1).astype(jnp.float32))


class SparsePayload(Compressor):
  """Base of the compressors whose payload is ``capacity(n)`` (value, index)
  pairs: ``values`` (in the gradient's dtype) and ``indices`` int32, decoded
  by scatter-add
  (one scatter-add for all devices' payloads in :meth:`decode_sum`).
  Subclasses define ``encode`` and ``capacity``."""

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


@register
@dataclasses.dataclass(frozen=True)
class Threshold(SparsePayload):
  """Sends the entries with ``|x| >= threshold``, at most ``capacity``.

  A fixed magnitude threshold (Strom 2015) sends a number of entries that
  changes from step to step; XLA needs a static payload, so at most
  ``k = ceil(capacity_ratio * n)`` travel. When more pass the threshold, the
  ``k`` largest are sent and the overflow stays in the error-feedback
  residual (the compressor is biased, so residual feedback is on by default);
  when fewer pass, the free slots carry zeros. ``threshold`` is a plain
  comparison, so it may be scheduled (``optax.inject_hyperparams``) without
  any capacity change.

  Payload: ``values`` float32 ``(k,)`` and ``indices`` int32 ``(k,)``:
  ``8 * k`` bytes, all-gathered.

  Args:
    threshold: magnitude threshold, >= 0 (same units as the gradient).
    capacity_ratio: fraction of entries that fits the payload, in (0, 1].

  Raises:
    ValueError: ``threshold`` < 0 or ``capacity_ratio`` outside (0, 1].

  References:
    Strom, Scalable Distributed DNN Training Using Commodity GPU Cloud
    Computing <https://www.isca-archive.org/interspeech_2015/strom15_interspeech.html>,
    2015; Dryden et al., Communication Quantization for Data-parallel Training
    of Deep Neural Networks <https://doi.org/10.1109/MLHPC.2016.004>, 2016.
  """

  name: ClassVar[str] = "threshold"
  biased: ClassVar[bool] = True
  threshold: float = 1e-3
  capacity_ratio: float = 0.01

  def __post_init__(self):
    _hparams.check_number(self.threshold, "threshold", low=0.0)
    check_ratio(self.capacity_ratio, "capacity_ratio")

  def capacity(self, n: int) -> int:
    return num_selected(self.capacity_ratio, n)

  def encode(self, x, key):
    del key
    eligible = (jnp.abs(x).astype(jnp.float32)
                >= _hparams.as_f32(self.threshold))
    values, idx = masked_topk(x, eligible, self.capacity(x.shape[0]))
    return {"values": values, "indices": idx}
