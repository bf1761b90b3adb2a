"""A bucket's parts: one flat array per tensor, and their concatenation.

A bucket of gradient tensors travels as *parts*, a tuple with one flat
``(size_i,)`` array per tensor in bucket order. Collectives that encode one
flat buffer concatenate them; error feedback keeps its state per part, so
that the per-tensor arithmetic needs no concatenation fused into it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

Parts = tuple  # tuple[jax.Array, ...]: one flat (size_i,) array per tensor
Shapes = tuple  # tuple[tuple[int, ...], ...]: each tensor's shape


def sizes(shapes: Sequence[Sequence[int]]) -> tuple[int, ...]:
  """Element counts of ``shapes``."""
  return tuple(math.prod(s) for s in shapes)


def concat(parts: Parts) -> jax.Array:
  """The parts as one flat array along their last axis (the bucket's layout;
  works on global arrays with a leading device axis too)."""
  return parts[0] if len(parts) == 1 else jnp.concatenate(parts, axis=-1)


def split(flat: jax.Array, part_sizes: Sequence[int]) -> Parts:
  """The inverse of :func:`concat`: ``flat`` (``(sum(part_sizes),)``) cut into
  consecutive pieces of ``part_sizes`` elements."""
  if len(part_sizes) == 1:
    return (flat,)
  return tuple(jnp.split(flat, list(itertools.accumulate(part_sizes))[:-1]))


class SparseParts:
  """A bucket's parts held sparsely: ``values[j]`` (float32 ``(k,)``) at flat
  bucket position ``indices[j]`` (int32 ``(k,)``; repeated positions add),
  over parts of ``sizes`` elements.

  What a sparse compressor contributed (its ``local``) is zero almost
  everywhere: :func:`sub` and :func:`add` apply it to dense parts by a
  scatter-add of its ``k`` entries into them (in place where XLA can reuse
  the parts' buffers), instead of writing ``n`` decoded zeros, copying them
  for each scatter and reading them back in a subtraction (5 passes over
  the bucket on XLA:CPU, ``jaxcomp.hlo.traffic.memory_passes``). The results are
  bit for bit those of the dense decode: ``x - (0 + v)`` and ``x + (-v)``
  round alike. Iterating gives the dense parts, for code that needs them.
  """

  def __init__(self, indices: jax.Array, values: jax.Array,
               part_sizes: Sequence[int]):
    self.indices = indices.reshape(-1).astype(jnp.int32)
    self.values = values.reshape(-1).astype(jnp.float32)
    self.sizes = tuple(part_sizes)

  # Each part's scatter visits all k entries (dropping the others'): past a
  # few parts that work (k per part) outgrows one scatter into the
  # concatenation, which costs two passes over the bucket instead.
  MAX_PARTS_SCATTERED_APART = 8

  def _scatter(self, targets: Parts, values: jax.Array) -> Parts:
    if len(self.sizes) > self.MAX_PARTS_SCATTERED_APART:
      flat = concat(targets).at[self.indices].add(values)
      return split(flat, self.sizes)
    out = []
    for offset, size, t in zip(itertools.accumulate((0,) + self.sizes),
                               self.sizes, targets):
      i = self.indices - offset
      # Out-of-part positions go to ``size`` and are dropped (a negative
      # index would wrap around instead).
      i = jnp.where((i >= 0) & (i < size), i, size)
      out.append(t.at[i].add(values, mode="drop"))
    return tuple(out)

  def dense(self) -> Parts:
    """The dense float32 parts: zeros with the entries added."""
    return self._scatter(tuple(jnp.zeros((n,), jnp.float32)
                               for n in self.sizes), self.values)

  def subtract_from(self, parts: Parts) -> Parts:
    return self._scatter(parts, -self.values)

  def add_to(self, parts: Parts) -> Parts:
    return self._scatter(parts, self.values)

  def __iter__(self):
    return iter(self.dense())

  def __len__(self):
    return len(self.sizes)


def add(a: Parts, b: Parts) -> Parts:
  if isinstance(b, SparseParts):
    return b.add_to(a)
  return tuple(x + y for x, y in zip(a, b))


def sub(a: Parts, b: Parts) -> Parts:
  if isinstance(b, SparseParts):
    return b.subtract_from(a)
  return tuple(x - y for x, y in zip(a, b))


def chunk_major(parts: Parts, p: int) -> jax.Array:
  """Parts of ``p * c_i`` elements each, laid out for a reduce-scatter over
  ``p`` devices: chunk ``j`` of the result (``sum c_i`` elements) is the
  concatenation of every part's ``j``-th ``c_i`` elements, so that device
  ``j`` receives each tensor's shard ``j``. Flat ``(p * sum c_i,)``."""
  return concat(tuple(x.reshape(p, -1) for x in parts)).reshape(-1)


def from_chunk_major(flat: jax.Array, part_sizes: Sequence[int],
                     p: int) -> Parts:
  """The inverse of :func:`chunk_major`: parts of ``part_sizes`` elements
  (each a multiple of ``p``)."""
  rows = flat.reshape(p, -1)
  widths = list(itertools.accumulate(n // p for n in part_sizes))
  return tuple(rows[:, a:b].reshape(-1)
               for a, b in zip([0] + widths[:-1], widths))
