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

import math

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


# -- Any width ----------------------------------------------------------------
#
# Codes of a width that does not divide 32 (the 12-bit index of an entry in
# a 4096-element chunk) use the same layout with codes allowed to straddle a
# word boundary: code ``j`` occupies bits ``[j * bits, (j + 1) * bits)`` of
# the little-endian bit stream of the words (word ``i`` holds stream bits
# ``[32 i, 32 i + 32)``). For widths that divide 32 these are the words of
# :func:`pack_bits_reference`.

MAX_CODE_BITS = 32


def _check_width(bits: int) -> None:
  if isinstance(bits, bool) or not isinstance(bits, int) or not (
      1 <= bits <= MAX_CODE_BITS):
    raise ValueError(f"bits must be an integer in [1, {MAX_CODE_BITS}], got "
                     f"{bits=!r}")


def code_words(n: int, bits: int) -> int:
  """uint32 words that hold ``n`` codes of ``bits`` bits each, packed end to
  end (:func:`pack_codes`): ``ceil(n * bits / 32)``.

  Raises:
    ValueError: ``bits`` not an integer in [1, 32].
  """
  _check_width(bits)
  return -(-n * bits // 32)


def _period(bits: int) -> tuple[int, int]:
  """(codes, words) of one period of the layout: lcm(bits, 32) bits."""
  g = math.gcd(bits, 32)
  return 32 // g, bits // g


def pack_codes(codes: jax.Array, bits: int) -> jax.Array:
  """Packs codes (< 2**bits) of any width into uint32 words, end to end.

  Args:
    codes: integer array ``(n,)``; each value's low ``bits`` bits are kept.
    bits: bits per code, 1 to 32.

  Returns:
    uint32 ``(code_words(n, bits),)``: ``4 * ceil(n * bits / 32)`` bytes.
    For ``bits`` in :data:`SUPPORTED_BITS`, the words of
    :func:`pack_bits_reference`.

  Raises:
    ValueError: ``bits`` not an integer in [1, 32], or ``codes`` not 1-D.
  """
  _check_width(bits)
  if codes.ndim != 1:
    raise ValueError(f"codes must be 1-D, got shape {codes.shape}")
  if bits in SUPPORTED_BITS:
    return pack_bits_reference(codes, bits)
  n = codes.shape[0]
  per, words = _period(bits)
  mask = jnp.uint32((1 << bits) - 1) if bits < 32 else jnp.uint32(0xFFFFFFFF)
  c = codes.astype(jnp.uint32) & mask
  periods = -(-n // per)
  c = jnp.pad(c, (0, periods * per - n)).reshape(periods, per)
  # Each word of a period is the sum (= bitwise or: disjoint bits) of the
  # pieces of the codes that overlap it; the layout within a period is
  # static.
  out = [jnp.zeros((periods,), jnp.uint32) for _ in range(words)]
  for j in range(per):
    start = j * bits
    word, shift = divmod(start, 32)
    out[word] = out[word] + (c[:, j] << jnp.uint32(shift))
    if shift + bits > 32:
      out[word + 1] = out[word + 1] + (c[:, j] >> jnp.uint32(32 - shift))
  return jnp.stack(out, axis=1).reshape(-1)[:code_words(n, bits)]


def unpack_codes(words: jax.Array, bits: int, n: int) -> jax.Array:
  """Inverse of :func:`pack_codes`: uint32 codes ``(n,)``.

  Raises:
    ValueError: ``bits`` not an integer in [1, 32], or ``words`` not of
      shape ``(code_words(n, bits),)``.
  """
  _check_width(bits)
  if words.shape != (code_words(n, bits),):
    raise ValueError(f"words must have shape ({code_words(n, bits)},) for "
                     f"{n=} and {bits=}, got {words.shape}")
  if bits in SUPPORTED_BITS:
    return unpack_bits_reference(words, bits, n)
  per, nwords = _period(bits)
  periods = -(-n // per)
  w = jnp.pad(words.astype(jnp.uint32), (0, periods * nwords - words.shape[0]))
  w = w.reshape(periods, nwords)
  mask = jnp.uint32((1 << bits) - 1) if bits < 32 else jnp.uint32(0xFFFFFFFF)
  out = []
  for j in range(per):
    start = j * bits
    word, shift = divmod(start, 32)
    c = w[:, word] >> jnp.uint32(shift)
    if shift + bits > 32:
      c = c | (w[:, word + 1] << jnp.uint32(32 - shift))
    out.append(c & mask)
  return jnp.stack(out, axis=1).reshape(-1)[:n]
