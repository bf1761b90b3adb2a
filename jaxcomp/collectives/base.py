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
  all payloads at once), else decodes each payload and adds it to a float32
  accumulator, device 0 first. (Decoding all payloads under ``vmap`` and
  reducing over the device axis made XLA:CPU run one slow fusion per bucket;
  in a profile of the 2-process QSGD step of
  ``benchmarks/validate_perfmodel.py`` it took most of the step.)
  """
  fn = getattr(compressor, "decode_sum", None)
  if fn is not None:
    return fn(payloads, n, key)
  p = jax.tree.leaves(payloads)[0].shape[0]
  one = lambda i: compressor.decode(jax.tree.map(lambda a: a[i], payloads), n, key
                                    ).astype(jnp.float32)
  if p <= _UNROLL_DECODES:
    acc = one(0)
    for i in range(1, p):
      acc = acc + one(i)
    return acc
  return lax.fori_loop(1, p, lambda i, acc: acc + one(i), one(0))


_UNROLL_DECODES = 16  # beyond this many devices, decode in a loop


class Collective:
  """Base class. Subclasses set ``name`` and implement ``exchange``."""

  name: ClassVar[str] = ""

  def check(self, compressor: Compressor) -> None:
    """Raises ValueError if this collective cannot carry ``compressor``."""
    if compressor.own_exchange:
      raise ValueError(
          f"compressor {compressor.name!r} runs its own exchange; use "
          f"collective=None or 'compressor', not {self.name!r}")

  def bind_axes(self, axis_name: AxisName) -> "Collective":
    """The collective to use over ``axis_name`` (called by :func:`get` at
    construction when the axes are known): ``self`` by default; collectives
    that split the axes (:class:`~jaxcomp.collectives.Hierarchical`) return
    a copy with them resolved.

    Raises:
      ValueError: this collective cannot run over ``axis_name``.
    """
    del axis_name
    return self

  def init_state(self, compressor: Compressor, n: int, axis_name: AxisName):
    """State for one bucket of ``n`` elements (inside shard_map/pmap)."""
    del compressor, n, axis_name
    return ()

  def device_key(self, compressor: Compressor, key: jax.Array,
                 axis_name: AxisName) -> jax.Array:
    """The key this device passes to ``exchange`` (inside shard_map/pmap).

    ``key`` is the same on every device. Compressors with independent
    randomness get it folded with this device's index along ``axis_name``;
    the others get it unchanged. Collectives that need the same key on a
    group of devices (:class:`~jaxcomp.collectives.Hierarchical`) override
    this.
    """
    if compressor.randomness == "independent":
      return jax.random.fold_in(key, lax.axis_index(axis_name))
    return key

  def exchange(self, compressor: Compressor, x: jax.Array, key: jax.Array,
               axis_name: AxisName, state=()):
    """Returns ``(mean, local, state)``; see the module docstring."""
    raise NotImplementedError

  def payload_bytes(self, compressor: Compressor, n: int,
                    num_devices: int) -> int:
    """Operand bytes one device hands to collectives for ``n`` elements."""
    del num_devices
    return compressor.payload_bytes(n)

  def ring_bytes(self, compressor: Compressor, n: int,
                 num_devices: int) -> float:
    """Bytes a bandwidth-optimal ring moves out of each device for one
    exchange of ``n`` elements: the measure :attr:`jaxcomp.Traffic.ring_bytes`
    reads from the compiled HLO. The base class counts the operand bytes as
    one all-gather, ``(p - 1)`` times."""
    return (num_devices - 1) * self.payload_bytes(compressor, n, num_devices)


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

  def ring_bytes(self, compressor, n, num_devices):
    p = num_devices
    return 2 * (p - 1) / p * self.payload_bytes(compressor, n, p)


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


def chunk_size(n: int, num_devices: int) -> int:
  """Elements per chunk when ``n`` is split into ``num_devices`` chunks
  (``ceil(n / num_devices)``; the last chunks are zero-padded)."""
  return -(-n // num_devices)


_REGISTRY: dict[str, Callable[[], Collective]] = {
    PsumMean.name: PsumMean,
    AllGatherMean.name: AllGatherMean,
    OwnExchange.name: OwnExchange,
}

# Quantizers (dense payloads, re-encodable after the reduction) whose default
# is two-phase where that moves fewer bytes; see :func:`default_for`.
TWO_PHASE_BY_DEFAULT = frozenset({"qsgd", "int8_block", "fp8_block"})


def register(cls):
  """Class decorator: registers a Collective subclass under ``cls.name``."""
  if cls.name in _REGISTRY:
    raise ValueError(f"collective name {cls.name!r} is already registered")
  _REGISTRY[cls.name] = cls
  return cls


def names() -> list[str]:
  return sorted(_REGISTRY)


def default_for(compressor: Compressor) -> Collective:
  """The collective :func:`jaxcomp.compressed_mean` uses when none is given.

  The rule, first match wins:

  1. ``own_exchange`` compressors (PowerSGD, TernGrad): their own exchange.
  2. Linear compressors (identity, casts, random-block, random-k): ``psum``,
     summed in flight by a ring all-reduce.
  3. A compressor that names a collective in a ``default_collective``
     attribute: that one.
  4. Quantizers (``TWO_PHASE_BY_DEFAULT``: QSGD, int8/fp8 block):
     ``"auto"``, which per bucket takes the two-phase all-reduce when its
     ring bytes ``2 (p - 1) * payload(ceil(n / p))`` are fewer than the
     all-gather's ``(p - 1) * payload(n)`` (so from 3 devices on, for
     buckets large enough that per-chunk headers do not dominate), and
     the all-gather otherwise (at 2 devices both move the same bytes and
     the all-gather needs one collective and no re-encoding).
  5. The others (top-k, threshold, sign, DGC): ``"allgather"``. Two-phase
     would re-sparsify the reduced chunks, a different algorithm; ask for
     it with ``collective="two_phase"``.
  """
  if compressor.own_exchange:
    return OwnExchange()
  if compressor.linear:
    return PsumMean()
  named = getattr(compressor, "default_collective", None)
  if named is not None:
    return get(named, compressor)
  if compressor.name in TWO_PHASE_BY_DEFAULT:
    return _REGISTRY["auto"]()
  return AllGatherMean()


def get(collective: str | Collective | None,
        compressor: Compressor, axis_name: AxisName | None = None) -> Collective:
  """Resolves a collective by name (None: :func:`default_for` the
  compressor).

  Args:
    collective: a registered name (:func:`names`), a Collective, or None.
    compressor: the compressor it will carry.
    axis_name: the axes it will run over, when known; checked with
      ``Collective.bind_axes``.

  Raises:
    ValueError: unknown name, a collective that cannot carry the
      compressor, or axes it cannot run over.
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
  if axis_name is not None:
    coll = coll.bind_axes(axis_name)
  return coll
