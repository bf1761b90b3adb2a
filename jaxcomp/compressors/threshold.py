"""Threshold sparsification: send the entries with |x| >= threshold, up to a
fixed capacity."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import check_ratio, num_selected, register
from jaxcomp.compressors.sparse import SparsePayload, largest_eligible
from jaxcomp.kernels import compact


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
  vmappable: ClassVar[bool] = False  # its lax.cond on the data
  threshold: float = 1e-3
  capacity_ratio: float = 0.01

  def __post_init__(self):
    _hparams.check_number(self.threshold, "threshold", low=0.0)
    check_ratio(self.capacity_ratio, "capacity_ratio")

  def capacity(self, n: int) -> int:
    return num_selected(self.capacity_ratio, n)

  def encode(self, x, key):
    """One pass packs ``|x| >= threshold`` into bit masks and counts them;
    when at most the capacity passes, they are compacted in index order (no
    sort); when more pass, the capacity's largest of them are taken exactly
    (:func:`~jaxcomp.compressors.sparse.largest_eligible`), and nothing is
    compacted first."""
    del key
    cap = self.capacity(x.shape[0])
    thr = _hparams.as_f32(self.threshold)
    passes = lambda v: jnp.abs(v).astype(jnp.float32) >= thr
    words = compact.pack(x, passes)

    def fits():
      idx, valid = compact.compact(words, cap)
      return jnp.where(valid, x[idx], 0), idx

    values, idx = lax.cond(compact.count(words) <= cap, fits,
                           lambda: largest_eligible(x, passes(x), cap))
    return {"values": values, "indices": idx}
