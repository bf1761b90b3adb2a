"""Collectives: how compressed payloads travel over a mesh axis.

A collective knows the compressor *interface* (``encode``, ``decode``,
``linear``), never a particular compressor. Per bucket it keeps a state
(``init_state``; ``()`` for stateless ones), and ``exchange(compressor, x,
key, axis_name, state)`` runs inside ``jax.shard_map`` / ``jax.pmap`` and
returns ``(mean, local, state)``:

* ``mean``: float32 ``(n,)``, the average over the axis of what every device
  sent, typed *invariant* (identical on every device, checked by
  ``check_vma``);
* ``local``: float32 ``(n,)``, what this device contributed to that mean, in
  the units of its input, so that error feedback can keep ``x - local`` as
  its residual;
* ``state``: the collective's new state for this bucket.

Compressors whose exchange is not one encode/transfer/decode round (PowerSGD's
two all-reduces, TernGrad's shared scale) set ``own_exchange = True`` and
implement ``init_state`` and ``exchange`` themselves; :class:`OwnExchange`
(the default for them) calls those.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp.compressors.base import Compressor

AxisName = str | tuple[str, ...]


def axis_size(axis_name: AxisName) -> int:
  """Number of devices along ``axis_name`` (static), inside shard_map/pmap."""
  return lax.axis_size(axis_name)


def decode_sum(compressor: Compressor, payloads, n: int, key) -> jax.Array:
  """Sum of the decodes of stacked payloads (leading axis: devices).

  Uses the compressor's own ``decode_sum`` where it has one (top-k scatter-adds
  all payloads at once), else decodes each payload and sums in float32.
  """
  fn = getattr(compressor, "decode_sum", None)
  if fn is not None:
    return fn(payloads, n, key)
  decoded = jax.vmap(lambda p: compressor.decode(p, n, key))(payloads)
  return jnp.sum(decoded, axis=0, dtype=jnp.float32)


class Collective:
  """Base class. Subclasses set ``name`` and implement ``exchange``."""

  name: ClassVar[str] = ""

  def check(self, compressor: Compressor) -> None:
    """Raises ValueError if this collective cannot carry ``compressor``."""
    if compressor.own_exchange:
      raise ValueError(
          f"compressor {compressor.name!r} runs its own exchange; use "
          f"collective=None or 'compressor', not {self.name!r}")

  def init_state(self, compressor: Compressor, n: int, axis_name: AxisName):
    """State for one bucket of ``n`` elements (inside shard_map/pmap)."""
    del compressor, n, axis_name
    return ()

  def exchange(self, compressor: Compressor, x: jax.Array, key: jax.Array,
               axis_name: AxisName, state=()):
    """Returns ``(mean, local, state)``; see the module docstring."""
    raise NotImplementedError

  def payload_bytes(self, compressor: Compressor, n: int,
                    num_devices: int) -> int:
    """Operand bytes one device hands to collectives for ``n`` elements."""
    del num_devices
    return compressor.payload_bytes(n)


@dataclasses.dataclass(frozen=True)
class PsumMean(Collective):
  """All-reduce (``lax.psum``) of the payload; for linear compressors only.

  The payload is summed in flight in its own dtype, then decoded and divided
  by the device count. Compressors with ``prescale`` (float16) are divided
  before encoding, so the sum cannot overflow.

  Per-device operand bytes: ``compressor.payload_bytes(n)``; a ring moves
  ``2 (p - 1) / p`` times that per device.
  """

  name: ClassVar[str] = "psum"

  def check(self, compressor):
    super().check(compressor)
    if not compressor.linear:
      raise ValueError(
          f"collective='psum' needs a linear compressor; {compressor.name!r} "
          "is not (its payloads cannot be summed in flight). Use "
          "collective='allgather'.")

  def exchange(self, compressor, x, key, axis_name, state=()):
    n = x.shape[0]
    p = axis_size(axis_name)
    if getattr(compressor, "prescale", False):
      payload = compressor.encode(x / p, key)
      mean = compressor.decode(lax.psum(payload, axis_name), n, key)
      local = compressor.decode(payload, n, key) * p
      return mean, local, state
    payload = compressor.encode(x, key)
    mean = compressor.decode(lax.psum(payload, axis_name), n, key) / p
    return mean, compressor.decode(payload, n, key), state


@dataclasses.dataclass(frozen=True)
class AllGatherMean(Collective):
  """All-gather of every device's payload, then a local decode and sum.

  Works for every compressor. Per-device operand bytes:
  ``compressor.payload_bytes(n)``, but every device *receives* ``p - 1``
  payloads, so traffic grows linearly with the device count (Agarwal et al.
  2022); :mod:`jaxcomp.hlo` reports that ring cost as ``(p - 1)`` times the
  operand bytes.
  """

  name: ClassVar[str] = "allgather"

  def exchange(self, compressor, x, key, axis_name, state=()):
    n = x.shape[0]
    p = axis_size(axis_name)
    payload = compressor.encode(x, key)
    gathered = jax.tree.map(
        lambda a: lax.all_gather(a, axis_name, to="invarying"), payload)
    mean = decode_sum(compressor, gathered, n, key) / p
    return mean, compressor.decode(payload, n, key), state


@dataclasses.dataclass(frozen=True)
class OwnExchange(Collective):
  """Lets a compressor with ``own_exchange`` run its own rounds (e.g.
  PowerSGD's all-reduces of P and Q); its state is the compressor's."""

  name: ClassVar[str] = "compressor"

  def check(self, compressor):
    if not compressor.own_exchange:
      raise ValueError(
          f"collective='compressor' needs a compressor that runs its own "
          f"exchange; {compressor.name!r} does not")

  def init_state(self, compressor, n, axis_name):
    return compressor.init_state(n, axis_name)

  def exchange(self, compressor, x, key, axis_name, state=()):
    return compressor.exchange(x, key, axis_name, state)

  def payload_bytes(self, compressor, n, num_devices):
    del num_devices
    return compressor.payload_bytes(n)


_REGISTRY: dict[str, Callable[[], Collective]] = {
    PsumMean.name: PsumMean,
    AllGatherMean.name: AllGatherMean,
    OwnExchange.name: OwnExchange,
}


def register(cls):
  """Class decorator: registers a Collective subclass under ``cls.name``."""
  if cls.name in _REGISTRY:
    raise ValueError(f"collective name {cls.name!r} is already registered")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def default_for(compressor: Compressor) -> Collective:
  """The compressor's own exchange where it has one, psum for linear
  compressors, all-gather for the others."""
  if compressor.own_exchange:
    return OwnExchange()
  return PsumMean() if compressor.linear else AllGatherMean()


def get(collective: str | Collective | None,
        compressor: Compressor) -> Collective:
  """Resolves a collective by name (None: the default for ``compressor``).

  Raises:
    ValueError: unknown name, or a collective that cannot carry the
      compressor.
  """
  if collective is None:
    coll = default_for(compressor)
  elif isinstance(collective, Collective):
    coll = collective
  elif isinstance(collective, str) and collective in _REGISTRY:
    coll = _REGISTRY[collective]()
  else:
    raise ValueError(
        f"unknown collective {collective!r}; choose one of {names()}")
  coll.check(compressor)
  return coll
