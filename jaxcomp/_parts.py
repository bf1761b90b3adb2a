"""A bucket's parts: one flat array per tensor, and their concatenation.

A bucket of gradient tensors travels as *parts*, a tuple with one flat
``(size_i,)`` array per tensor in bucket order. Collectives that encode one
flat buffer concatenate them; error feedback keeps its state per part, so
that the per-tensor arithmetic needs no concatenation fused into it.
"""

from __future__ import annotations

import itertools
import math
from typing import Sequence

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


def add(a: Parts, b: Parts) -> Parts:
  return tuple(x + y for x, y in zip(a, b))


def sub(a: Parts, b: Parts) -> Parts:
  return tuple(x - y for x, y in zip(a, b))
