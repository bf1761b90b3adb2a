"""A small decoder-only transformer (pre-LayerNorm, learned positions)."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
from optax.contrib import MuonDimensionNumbers


class Block(nn.Module):
  """Causal self-attention and a 4x GELU MLP, each with a pre-LayerNorm
  residual branch."""

  d_model: int
  num_heads: int

  @nn.compact
  def __call__(self, x, mask):
    h = nn.LayerNorm()(x)
    h = nn.MultiHeadDotProductAttention(num_heads=self.num_heads,
                                        qkv_features=self.d_model)(
                                            h, h, mask=mask)
    x = x + h
    h = nn.LayerNorm()(x)
    h = nn.Dense(4 * self.d_model)(h)
    h = nn.Dense(self.d_model)(nn.gelu(h))
    return x + h


class CharTransformer(nn.Module):
  """Maps int32 tokens ``(batch, length)`` to float32 logits
  ``(batch, length, vocab_size)``; position ``t`` sees tokens ``<= t``.

  The default (vocab 256, context 64, d_model 128, 2 layers) has about 0.47M
  parameters.
  """

  vocab_size: int = 256
  context: int = 64
  d_model: int = 128
  num_layers: int = 2
  num_heads: int = 4

  @nn.compact
  def __call__(self, tokens):
    length = tokens.shape[-1]
    if length > self.context:
      raise ValueError(f"sequence length {length} exceeds context={self.context}")
    x = nn.Embed(self.vocab_size, self.d_model)(tokens)
    pos = self.param("pos_embedding", nn.initializers.normal(0.02),
                     (self.context, self.d_model))
    x = x + pos[None, :length]
    mask = nn.make_causal_mask(tokens)
    for _ in range(self.num_layers):
      x = Block(self.d_model, self.num_heads)(x, mask)
    x = nn.LayerNorm()(x)
    return nn.Dense(self.vocab_size)(x).astype(jnp.float32)


def muon_dimensions(params):
  """Which parameters Muon orthogonalizes, as ``optax.contrib.muon``'s
  ``muon_weight_dimension_numbers``: the hidden matrices of the blocks
  (the MLP's ``(d, 4d)`` and ``(4d, d)`` kernels; attention's ``(d, heads,
  head_dim)`` query, key and value kernels as ``(d, heads * head_dim)``
  matrices and its ``(heads, head_dim, d)`` output kernel as a
  ``(heads * head_dim, d)`` one). The embeddings, the output layer, biases
  and norms get None: Adam (Muon's usual split, Jordan's modded-nanogpt and
  MuLoCo)."""

  def spec(path, x):
    names = [getattr(k, "key", None) for k in path]
    if not str(names[0]).startswith("Block_") or names[-1] != "kernel":
      return None
    if x.ndim == 2:
      return MuonDimensionNumbers(0, 1)
    if names[-2] == "out":  # (heads, head_dim, d)
      return MuonDimensionNumbers((0, 1), 2)
    return MuonDimensionNumbers(0, (1, 2))  # (d, heads, head_dim)

  return jax.tree_util.tree_map_with_path(spec, params)
