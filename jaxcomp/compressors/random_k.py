"""Random-k sparsification with a shared key (psum carries it, no indices)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxcomp import _parts
from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, ratio_slots, register
from jaxcomp.kernels import dither


@register
@dataclasses.dataclass(frozen=True)
class RandomK(Compressor):
  """Sends k = ceil(ratio * n) entries chosen uniformly at random, without
  replacement, with a key shared by all devices.

  The coordinates are the first ``k`` values of a keyed pseudo-random
  permutation of ``[0, n)`` (:func:`jaxcomp.kernels.dither.permutation_prefix`:
  ``O(k)`` work, where sorting a permutation of all ``n`` costs
  ``O(n log n)``). Every device picks the same coordinates (the key is the same everywhere
  and changes every step), so no indices travel and ``lax.psum`` sums the
  values in flight. With ``unbiased=False`` (default) the unsent entries are
  dropped and :func:`jaxcomp.compressed_mean` adds residual error feedback;
  with ``unbiased=True`` the sent entries are scaled by ``n / k`` so that
  ``E[decode(encode(x))] = x`` (variance ``(n / k - 1) ||x||^2``) and no
  error feedback is added by default.

  ``ratio`` may be scheduled (``optax.inject_hyperparams``) when
  ``max_ratio`` fixes the capacity ``k_max = ceil(max_ratio * n)``: the
  payload always holds ``k_max`` values and the entries beyond the traced
  ``k`` are sent as zeros. A buffer with fewer elements than ``k`` sends all
  of them (k is capped at n).

  Payload: ``(k,)`` in the gradient's dtype (``(k_max,)`` with
  ``max_ratio``): ``4 * k``
  bytes.

  Args:
    ratio: fraction of entries sent, in (0, 1].
    unbiased: scale the sent entries by ``n / k``.
    max_ratio: static capacity when ``ratio`` is scheduled, in (0, 1], or None.

  Raises:
    ValueError: ``ratio`` or ``max_ratio`` outside (0, 1], ``ratio >
      max_ratio``, or a traced ``ratio`` without ``max_ratio``.

  References:
    Stich, Cordonnier & Jaggi, Sparsified SGD with Memory
    <https://arxiv.org/abs/1809.07599>, 2018; Wangni et al., Gradient
    Sparsification for Communication-Efficient Distributed Optimization
    <https://arxiv.org/abs/1710.09854>, 2018.
  """

  name: ClassVar[str] = "random_k"
  linear: ClassVar[bool] = True
  randomness: ClassVar[str] = "shared"
  ratio: float = 0.01
  unbiased: bool = False
  max_ratio: float | None = None

  def __post_init__(self):
    _hparams.check_ratio_capacity(self.ratio, self.max_ratio)

  @property
  def biased(self):
    return not self.unbiased

  def capacity(self, n: int) -> int:
    return ratio_slots(self.ratio, self.max_ratio, n)

  def k(self, n: int) -> jax.Array:
    """int32 scalar: the number of entries really sent (<= capacity)."""
    return _hparams.ceil_count(self.ratio, n, self.capacity(n))

  def indices(self, n: int, key: jax.Array) -> jax.Array:
    """int32 ``(capacity,)``: distinct coordinates drawn with ``key``."""
    return dither.permutation_prefix(key, n, self.capacity(n))

  def _weights(self, n):
    cap = self.capacity(n)
    k = self.k(n)
    live = jnp.arange(cap) < k
    scale = jnp.float32(n) / k.astype(jnp.float32) if self.unbiased else 1.0
    return jnp.where(live, scale, 0.0).astype(jnp.float32)

  def encode(self, x, key):
    n = x.shape[0]
    # The values travel in the gradient's dtype (scaled in float32 first).
    return (x[self.indices(n, key)].astype(jnp.float32)
            * self._weights(n)).astype(x.dtype)

  def decode(self, payload, n, key):
    return self.decode_parts(payload, (n,), key).dense()[0]

  def decode_parts(self, payload, part_sizes, key):
    """The payload at its coordinates, as sparse parts."""
    return _parts.SparseParts(self.indices(sum(part_sizes), key), payload,
                              part_sizes)

  def payload_bytes(self, n: int) -> int:
    return 4 * self.capacity(n)
