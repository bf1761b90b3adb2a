"""Bit packing of narrow unsigned integers into uint32 words (the wire format).

Every quantizing compressor in jaxcomp puts its codes on the wire with this
layout, and every Pallas kernel that packs must produce the same words:

* ``bits`` is one of 1, 2, 4, 8, 16, so ``per_word = 32 // bits`` codes share
  one uint32 word and no code straddles two words;
* code ``j`` of a word (``0 <= j < per_word``) occupies bits
  ``[j * bits, (j + 1) * bits)`` (little-endian within the word);
* the input is zero-padded to a multiple of ``per_word``; the packed array has
  ``ceil(n / per_word)`` words, i.e. ``4 * ceil(n * bits / 32)`` bytes.

This module is pure ``jnp`` (it is the reference and the XLA path) and imports
nothing of jaxcomp.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

SUPPORTED_BITS = (1, 2, 4, 8, 16)


def _check_bits(bits: int) -> int:
  if bits not in SUPPORTED_BITS:
    raise ValueError(f"bits must be one of {SUPPORTED_BITS}, got {bits=}")
  return 32 // bits


def packed_words(n: int, bits: int) -> int:
  """Number of uint32 words that hold ``n`` codes of ``bits`` bits each."""
  per_word = _check_bits(bits)
  return -(-n // per_word)


def pack_bits_reference(codes: jax.Array, bits: int) -> jax.Array:
  """Packs codes (< 2**bits) into uint32 words.

  Args:
    codes: unsigned or signed integer array, shape ``(n,)``, every value in
      ``[0, 2**bits)``. Values outside are masked to their low ``bits`` bits.
    bits: bits per code, one of 1, 2, 4, 8, 16.

  Returns:
    uint32 array of shape ``(ceil(n * bits / 32),)``.

  Raises:
    ValueError: ``bits`` is not supported or ``codes`` is not 1-D.
  """
  per_word = _check_bits(bits)
  if codes.ndim != 1:
    raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
  n = codes.shape[0]
  c = codes.astype(jnp.uint32) & jnp.uint32((1 << bits) - 1)
  # The whole words are a reshape of the codes and the last partial word a
  # slice: zero-padding all n codes instead makes XLA:CPU copy them and run
  # the packing loop unvectorised (2.5x slower at n = 1.86M, 2-bit codes).
  full = n // per_word
  parts = []
  if full:
    parts.append(_pack_rows(c[:full * per_word].reshape(full, per_word), bits))
  if n % per_word:
    tail = jnp.pad(c[full * per_word:], (0, per_word - n % per_word))
    parts.append(_pack_rows(tail.reshape(1, per_word), bits))
  if not parts:
    return jnp.zeros((0,), jnp.uint32)
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts)


def _pack_rows(c: jax.Array, bits: int) -> jax.Array:
  shifts = (jnp.arange(c.shape[1], dtype=jnp.uint32) * jnp.uint32(bits))[None, :]
  # Codes occupy disjoint bit ranges, so the sum is the bitwise or.
  return jnp.sum(c << shifts, axis=1, dtype=jnp.uint32)


def unpack_bits_reference(words: jax.Array, bits: int, n: int) -> jax.Array:
  """Inverse of :func:`pack_bits_reference`: uint32 codes of shape ``(n,)``."""
  per_word = _check_bits(bits)
  if words.shape != (packed_words(n, bits),):
    raise ValueError(
        f"words must have shape ({packed_words(n, bits)},) for {n=} and "
        f"{bits=}, got {words.shape}")
  shifts = (jnp.arange(per_word, dtype=jnp.uint32) * jnp.uint32(bits))[None, :]
  mask = jnp.uint32((1 << bits) - 1)
  codes = (words.astype(jnp.uint32)[:, None] >> shifts) & mask
  return codes.reshape(-1)[:n]
