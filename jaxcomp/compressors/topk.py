"""Top-k sparsification by magnitude."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import check_implementation, ratio_slots, register
from jaxcomp.compressors.sparse import SparsePayload
from jaxcomp.kernels import topk as topk_kernels


@register
@dataclasses.dataclass(frozen=True)
class TopK(SparsePayload):
  """Sends the k = ceil(ratio * n) entries of largest magnitude.

  Exact selection: the same set as ``lax.top_k`` of ``|x|`` (ties go to the
  lower index). What runs, with ``implementation=None`` on every backend, is
  the XLA path (:func:`jaxcomp.kernels.topk.topk_auto`): ``lax.top_k`` and an
  index sort below :func:`jaxcomp.kernels.topk.fast_path_min_size` elements
  (2^19 on CPU, 2^22 on GPU), and from there the sampled-threshold fast path
  (a threshold bracket from an evenly spaced sample, bit-mask compaction of
  the candidates, an exact sort of the bracket only). The Pallas radix
  select runs only with ``implementation="pallas"`` (on an H100 it was
  slower than the XLA path at every size measured). Biased, so
  :func:`jaxcomp.compressed_mean` turns residual error feedback on by
  default. Not linear: the payloads are all-gathered and every device
  scatter-adds all of them.

  Payload: ``values`` ``(k,)`` in the gradient's dtype and ``indices`` int32
  ``(k,)``: ``8 * k`` bytes for float32 (``6 * k`` for bfloat16). With
  ``max_ratio`` (a scheduled ``ratio``), the payload always has ``k_max =
  ceil(max_ratio * n)`` slots and the entries beyond the ``ceil(ratio * n)``
  largest are sent as zeros.

  Args:
    ratio: fraction of entries sent, in (0, 1]; may be traced (a schedule
      under ``optax.inject_hyperparams``) when ``max_ratio`` is set.
    max_ratio: static capacity for a scheduled ``ratio``, or None.
    implementation: ``"pallas"`` (radix-select kernels), ``"xla"`` or None
      (the XLA path on every backend, measured faster on an H100; see
      :func:`jaxcomp.kernels.topk.topk_auto`).

  Raises:
    ValueError: ``ratio`` or ``max_ratio`` outside (0, 1], ``ratio >
      max_ratio``, a traced ``ratio`` without ``max_ratio``, or an unknown
      ``implementation``.

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

  def __post_init__(self):
    _hparams.check_ratio_capacity(self.ratio, self.max_ratio)
    check_implementation(self.implementation)

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
    return {"values": values, "indices": idx.astype(jnp.int32)}
