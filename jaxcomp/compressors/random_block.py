"""Random-block sparsification with a shared key (psum-compatible)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxcomp import _parts
from jaxcomp.compressors import _hparams
from jaxcomp.compressors.base import Compressor, ratio_slots, register


@register
@dataclasses.dataclass(frozen=True)
class RandomBlock(Compressor):
  """Sends one contiguous block of b = ceil(ratio * n) entries.

  The block starts at an offset drawn from the key, which is the same on every
  device, and wraps around the end of the buffer; so every device sends the
  same coordinates, no indices travel, and ``lax.psum`` sums the blocks.
  Biased (unsent coordinates are dropped), so error feedback is on by default.

  ``ratio`` may be scheduled (``optax.inject_hyperparams``) with
  ``max_ratio`` as the static capacity: the block always has
  ``b_max = ceil(max_ratio * n)`` slots, and the entries past the traced
  ``ceil(ratio * n)`` are sent as zeros (and stay in the residual).

  Payload: float32 ``(b,)`` (``(b_max,)`` with ``max_ratio``): ``4 * b``
  bytes.

  Args:
    ratio: fraction of entries sent, in (0, 1]; may be traced when
      ``max_ratio`` is set.
    max_ratio: static capacity for a scheduled ``ratio``, or None.

  Raises:
    ValueError: ``ratio`` or ``max_ratio`` outside (0, 1], ``ratio >
      max_ratio``, or a traced ``ratio`` without ``max_ratio``.

  References:
    Eghlidi & Jaggi, Sparse Communication for Training Deep Networks
    <https://arxiv.org/abs/2009.09271>, 2020.
  """

  name: ClassVar[str] = "random_block"
  linear: ClassVar[bool] = True
  biased: ClassVar[bool] = True
  randomness: ClassVar[str] = "shared"
  ratio: float = 0.01
  max_ratio: float | None = None

  def __post_init__(self):
    _hparams.check_ratio_capacity(self.ratio, self.max_ratio)

  def block_size(self, n: int) -> int:
    """Payload slots: ``ceil(ratio * n)``, or the capacity with max_ratio."""
    return ratio_slots(self.ratio, self.max_ratio, n)

  def block_indices(self, n: int, key: jax.Array) -> jax.Array:
    """int32 indices ``(b,)`` of the block for this key."""
    start = jax.random.randint(key, (), 0, n, dtype=jnp.int32)
    return (start + jnp.arange(self.block_size(n), dtype=jnp.int32)) % n

  def encode(self, x, key):
    n = x.shape[0]
    values = x[self.block_indices(n, key)]
    if self.max_ratio is None:
      return values
    live = jnp.arange(values.shape[0]) < _hparams.ceil_count(
        self.ratio, n, self.block_size(n))
    return jnp.where(live, values, jnp.zeros((), values.dtype))

  def decode(self, payload, n, key):
    return jnp.zeros((n,), jnp.float32).at[self.block_indices(n, key)].set(
        payload.astype(jnp.float32))

  def decode_parts(self, payload, part_sizes, key):
    """The block at its coordinates, as sparse parts (distinct indices:
    adding into zeros is setting, up to the sign of a zero)."""
    return _parts.SparseParts(self.block_indices(sum(part_sizes), key),
                              payload, part_sizes)

  def payload_bytes(self, n: int) -> int:
    return 4 * self.block_size(n)
