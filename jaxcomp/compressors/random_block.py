"""Random-block sparsification with a shared key (psum-compatible)."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp

from jaxcomp.compressors.base import (Compressor, check_ratio, num_selected,
                                      register)


@register
@dataclasses.dataclass(frozen=True)
class RandomBlock(Compressor):
  """Sends one contiguous block of b = ceil(ratio * n) entries.

  The block starts at an offset drawn from the key, which is the same on every
  device, and wraps around the end of the buffer; so every device sends the
  same coordinates, no indices travel, and ``lax.psum`` sums the blocks.
  Biased (unsent coordinates are dropped), so error feedback is on by default.

  Payload: float32 ``(b,)``: ``4 * b`` bytes.

  Args:
    ratio: fraction of entries sent, in (0, 1].

  Raises:
    ValueError: ``ratio`` outside (0, 1].

  References:
    Eghlidi & Jaggi, Sparse Communication for Training Deep Networks
    <https://arxiv.org/abs/2009.09271>, 2020.
  """

  name: ClassVar[str] = "random_block"
  linear: ClassVar[bool] = True
  biased: ClassVar[bool] = True
  randomness: ClassVar[str] = "shared"
  ratio: float = 0.01

  def __post_init__(self):
    check_ratio(self.ratio)

  def block_size(self, n: int) -> int:
    return num_selected(self.ratio, n)

  def block_indices(self, n: int, key: jax.Array) -> jax.Array:
    """int32 indices ``(b,)`` of the block for this key."""
    start = jax.random.randint(key, (), 0, n, dtype=jnp.int32)
    return (start + jnp.arange(self.block_size(n), dtype=jnp.int32)) % n

  def encode(self, x, key):
    return x[self.block_indices(x.shape[0], key)]

  def decode(self, payload, n, key):
    return jnp.zeros((n,), jnp.float32).at[self.block_indices(n, key)].set(
        payload.astype(jnp.float32))

  def payload_bytes(self, n: int) -> int:
    return 4 * self.block_size(n)
