"""Bytes on the wire and messages per collective kind: the one cost table.

Every figure jaxcomp reports or predicts about traffic comes from here: the
collectives' statistics (:class:`jaxcomp.CompressionStats`), the traffic read
from a compiled module (:func:`jaxcomp.collective_traffic`) and the
performance model (:mod:`jaxcomp.perfmodel`).

A collective over a group of ``g`` devices, each handing in ``m`` operand
bytes, run by the bandwidth-optimal ring algorithms (Thakur, Rabenseifner &
Gropp, Optimization of Collective Communication Operations in MPICH, 2005;
the model of Agarwal et al. 2022 and Shi et al. 2019), moves out of each
device:

==================  ====================  =====================
kind                ring bytes            ring messages (steps)
==================  ====================  =====================
all-reduce          ``2 (g - 1) / g m``   ``2 (g - 1)``
all-gather          ``(g - 1) m``         ``g - 1``
reduce-scatter      ``(g - 1) / g m``     ``g - 1``
all-to-all          ``(g - 1) / g m``     ``g - 1``
collective-permute  ``m``                 ``1``
==================  ====================  =====================

An alpha-beta link then prices one collective at ``messages * alpha + bytes
* beta`` (:mod:`jaxcomp.perfmodel.costs`). A group of one device moves
nothing.
"""

from __future__ import annotations

import dataclasses
import math

from jaxcomp._mesh import AxisName

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all",
         "collective-permute")


# kind: (ring bytes per operand byte, ring messages), for a group of g >= 2.
_RING = {
    "all-reduce": (lambda g: 2 * (g - 1) / g, lambda g: 2 * (g - 1)),
    "all-gather": (lambda g: g - 1, lambda g: g - 1),
    "reduce-scatter": (lambda g: (g - 1) / g, lambda g: g - 1),
    "all-to-all": (lambda g: (g - 1) / g, lambda g: g - 1),
    "collective-permute": (lambda g: 1, lambda g: 1),
}


def _ring(kind: str):
  if kind not in _RING:
    raise ValueError(f"unknown collective kind {kind!r}; expected one of "
                     f"{KINDS}")
  return _RING[kind]


def ring_bytes(kind: str, operand_bytes: float, group_size: int) -> float:
  """Bytes one device sends for one collective of ``kind`` (see the table).

  Args:
    kind: one of :data:`KINDS`.
    operand_bytes: bytes this device hands in (for an all-gather, its own
      contribution).
    group_size: devices in the collective's group.

  Raises:
    ValueError: an unknown ``kind``.

  Example:
    >>> ring_bytes("all-reduce", 1000, 8)  # 2 (g - 1) / g of the buffer
    1750.0
    >>> ring_bytes("all-gather", 1000, 8)  # every peer's payload
    7000.0
  """
  factor, _ = _ring(kind)
  return 0.0 if group_size <= 1 else float(factor(group_size) * operand_bytes)


def ring_messages(kind: str, group_size: int) -> int:
  """Messages (ring steps, each paying the link's start-up cost alpha) one
  device sends for one collective of ``kind`` (see the table).

  Raises:
    ValueError: an unknown ``kind``.
  """
  _, messages = _ring(kind)
  return 0 if group_size <= 1 else messages(group_size)


@dataclasses.dataclass(frozen=True)
class Transfer:
  """One collective that a compressed exchange issues, per device.

  Attributes:
    kind: one of :data:`KINDS`.
    operand_bytes: bytes this device hands in (one payload array; an int
      for everything the library sends, a float only for the performance
      model's hypothetical compressors).
    axis_name: the mesh axes it runs over.
    group_size: devices in its group (the product of those axes' sizes).
  """

  kind: str
  operand_bytes: int | float
  axis_name: AxisName
  group_size: int

  def __post_init__(self):
    _ring(self.kind)

  @property
  def ring_bytes(self) -> float:
    """Bytes this device sends by the ring algorithm (:func:`ring_bytes`)."""
    return ring_bytes(self.kind, self.operand_bytes, self.group_size)

  @property
  def messages(self) -> int:
    """Ring steps this device sends (:func:`ring_messages`)."""
    return ring_messages(self.kind, self.group_size)


def group_size(axis_name: AxisName, sizes: dict[str, int]) -> int:
  """Devices in a group over ``axis_name``, from ``{axis: size}``."""
  names = (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)
  return math.prod(sizes[a] for a in names)


def axes_of(sizes: dict[str, int]) -> AxisName:
  """The axis name (a string, or a tuple of several) of ``{axis: size}``."""
  names = tuple(sizes)
  return names[0] if len(names) == 1 else names


def devices(sizes: dict[str, int]) -> int:
  """Devices in the group over every axis of ``{axis: size}``."""
  return group_size(tuple(sizes), sizes)


def transfers(kind: str, array_bytes, axis_name: AxisName,
              sizes: dict[str, int]) -> tuple[Transfer, ...]:
  """One :class:`Transfer` of ``kind`` over ``axis_name`` per payload array
  of ``array_bytes`` bytes (XLA runs one collective per array of a payload
  on CPU, each paying the start-up cost)."""
  g = group_size(axis_name, sizes)
  return tuple(Transfer(kind, b if isinstance(b, float) else int(b), axis_name, g)
               for b in array_bytes)


def operand_bytes(ts) -> int:
  """Operand bytes of transfers ``ts``, summed."""
  return sum(t.operand_bytes for t in ts)


def total_ring_bytes(ts) -> float:
  """Ring bytes of transfers ``ts``, summed."""
  return sum(t.ring_bytes for t in ts)
