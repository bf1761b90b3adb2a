"""Top-k sparsification by magnitude."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors.base import (Compressor, check_ratio, num_selected,
                                      register)


@register
@dataclasses.dataclass(frozen=True)
class TopK(Compressor):
  """Sends the k = ceil(ratio * n) entries of largest magnitude.

  Exact selection (``lax.top_k`` of ``|x|``; ties go to the lower index).
  Biased, so :func:`jaxcomp.compressed_mean` turns residual error feedback on
  by default. Not linear: the payloads are all-gathered and every device
  scatter-adds all of them.

  Payload: ``values`` float32 ``(k,)`` and ``indices`` int32 ``(k,)``:
  ``8 * k`` bytes.

  Args:
    ratio: fraction of entries sent, in (0, 1].

  Raises:
    ValueError: ``ratio`` outside (0, 1].

  References:
    Aji & Heafield, Sparse Communication for Distributed Gradient Descent
    <https://arxiv.org/abs/1704.05021>, 2017; Stich et al., Sparsified SGD
    with Memory <https://arxiv.org/abs/1809.07599>, 2018.
  """

  name: ClassVar[str] = "topk"
  biased: ClassVar[bool] = True
  ratio: float = 0.01

  def __post_init__(self):
    check_ratio(self.ratio)

  def k(self, n: int) -> int:
    return num_selected(self.ratio, n)

  def encode(self, x, key):
    del key
    _, idx = lax.top_k(jnp.abs(x), self.k(x.shape[0]))
    return {"values": x[idx], "indices": idx.astype(jnp.int32)}

  def decode(self, payload, n, key):
    del key
    return jnp.zeros((n,), jnp.float32).at[payload["indices"]].add(
        payload["values"])

  def decode_sum(self, payloads, n, key):
    """Sum of stacked payloads (leading axis = devices) in one scatter-add."""
    del key
    return jnp.zeros((n,), jnp.float32).at[payloads["indices"].reshape(-1)].add(
        payloads["values"].reshape(-1))

  def payload_bytes(self, n: int) -> int:
    return 8 * self.k(n)
