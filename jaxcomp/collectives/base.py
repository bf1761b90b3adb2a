"""Collectives: how compressed payloads travel over a mesh axis.

A collective knows the compressor *interface*
(:class:`jaxcomp.compressors.Compressor`), never a particular compressor.
One bucket of gradient tensors goes through::

  mean, local, state = collective.exchange(
      compressor, parts, shapes, key=key, step=step, axis_name=axis_name,
      state=state)

inside ``jax.shard_map`` / ``jax.pmap``, where ``parts`` holds one flat
float32 ``(size_i,)`` array per tensor of ``shapes`` (the error-corrected
gradient, :mod:`jaxcomp._parts`) and, per tensor:

* ``mean``: float32 ``(size_i,)``, the average over the axis of what every
  device sent, typed *invariant* (identical on every device, checked by
  ``check_vma``);
* ``local``: float32 ``(size_i,)``, what this device contributed to that
  mean, in the units of its input, so that error feedback can keep
  ``x - local`` as its residual;
* ``state``: the collective's new state for this bucket (``init_state``;
  ``()`` for stateless collectives).

Collectives that encode one flat buffer implement ``exchange_buffer`` on the
bucket's concatenation, which this base class builds and cuts back into
tensors; compressors with ``own_exchange`` (PowerSGD, TernGrad, majority
vote) get the tensors themselves through :class:`OwnExchange`.

``transfers(compressor, shapes, sizes)`` lists the collectives one exchange
issues (:class:`jaxcomp.wire.Transfer`); every byte and message count
(statistics, traffic, the performance model) is read from it.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _parts
from jaxcomp import wire
from jaxcomp._mesh import AxisName, axis_size
from jaxcomp._registry import Registry
from jaxcomp.compressors.base import Compressor
from jaxcomp.wire import axes_of

Sizes = dict  # dict[str, int]: {mesh axis: devices}, the axes averaged over


class Collective:
  """Base class. Subclasses set ``name`` and implement ``exchange_buffer`` and
  ``buffer_transfers`` (or, working on the tensors, ``exchange``,
  ``init_state`` and ``transfers``); one that moves the payload by a single
  collective may name its kind in ``payload_kind`` instead of writing
  ``buffer_transfers``."""

  name: ClassVar[str] = ""
  payload_kind: ClassVar[str | None] = None  # a kind of jaxcomp.wire.KINDS
  # Whether reduce_scatter_buffer is defined (compressed_mean(output="shard")),
  # and the collective kind it moves the chunk payloads by.
  reduce_scatter: ClassVar[bool] = True
  reduce_scatter_kind: ClassVar[str] = "all-to-all"

  @property
  def topology(self) -> str:
    """How this collective's per-device state moves to a mesh of another
    size (what :func:`jaxcomp.checkpoint.topology_rules` applies):
    ``"average"`` (every new device gets the mean of the saved ones: the
    pending correction's mean is kept), ``"rechunk"`` (the saved rows are
    one buffer's chunks, cut anew for the new device count) or ``"refuse:
    <why>"``. The default refuses: a collective whose per-device state can
    move says how."""
    return (f"refuse: the {self.name!r} collective's per-device state has no "
            "sound rule for another mesh")

  def unsent(self, compressor: Compressor, state):
    """What this device holds back in ``state`` (a bucket's state from
    :meth:`init_state`): float32 arrays whose mass is still to be sent (a
    second-phase residual, an overflow), or None. The transform's
    ``residual_norm`` statistic counts them with the feedback's
    (:meth:`jaxcomp.feedback.Feedback.unsent`): everything not sent has
    one interface, whichever part keeps it."""
    del compressor, state
    return None

  def check(self, compressor: Compressor) -> None:
    """Raises ValueError if this collective cannot carry ``compressor``."""
    if compressor.own_exchange:
      raise ValueError(
          f"compressor {compressor.name!r} runs its own exchange; use "
          f"collective=None or 'own_exchange', not {self.name!r}")

  def bind_axes(self, axis_name: AxisName) -> Collective:
    """The collective to use over ``axis_name`` (called by :func:`get` at
    construction when the axes are known): ``self`` by default; collectives
    that split the axes (:class:`~jaxcomp.collectives.Hierarchical`) return
    a copy with them resolved.

    Raises:
      ValueError: this collective cannot run over ``axis_name``.
    """
    del axis_name
    return self

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

  def init_state(self, compressor: Compressor, shapes: _parts.Shapes,
                 key: jax.Array, axis_name: AxisName):
    """State for one bucket of tensors of ``shapes`` (inside shard_map/pmap);
    ``key`` is the same on every device."""
    del key
    return self.init_buffer(compressor, sum(_parts.sizes(shapes)), axis_name)

  def init_buffer(self, compressor: Compressor, n: int, axis_name: AxisName):
    """State for one flat ``n``-element buffer: ``()`` by default."""
    del compressor, n, axis_name
    return ()

  def exchange(self, compressor: Compressor, parts: _parts.Parts,
               shapes: _parts.Shapes, *, key: jax.Array, step: jax.Array,
               axis_name: AxisName, state=()):
    """Returns ``(mean, local, state)``, per tensor; see the module
    docstring. The base class runs :meth:`exchange_buffer` on the
    concatenation of ``parts``."""
    del step
    return self.exchange_concatenated(compressor, _parts.concat(parts),
                               _parts.sizes(shapes), key, axis_name, state)

  def exchange_concatenated(self, compressor: Compressor, x: jax.Array,
                     part_sizes, key: jax.Array, axis_name: AxisName,
                     state=()):
    """``(mean, local, state)`` for one flat float32 buffer, returned as
    parts of ``part_sizes`` elements (``local`` possibly a
    :class:`jaxcomp._parts.SparseParts`): :meth:`exchange_buffer`, split."""
    mean, local, state = self.exchange_buffer(compressor, x, key, axis_name,
                                            state)
    return (_parts.split(mean, part_sizes), _parts.split(local, part_sizes),
            state)

  def exchange_buffer(self, compressor: Compressor, x: jax.Array,
                    key: jax.Array, axis_name: AxisName, state=()):
    """``(mean, local, state)`` for one flat float32 ``(n,)`` buffer."""
    raise NotImplementedError

  def transfers(self, compressor: Compressor, shapes: _parts.Shapes,
                sizes: Sizes, dtype=jnp.float32) -> tuple[wire.Transfer, ...]:
    """The collectives one exchange of a bucket of ``shapes`` (a gradient
    of ``dtype``) issues, per device, over the axes of ``sizes`` (``{axis:
    devices}``), by the compressor bound to those shapes
    (:meth:`jaxcomp.compressors.Compressor.for_shapes`)."""
    return self.buffer_transfers(compressor.for_shapes(shapes),
                               sum(_parts.sizes(shapes)), sizes, dtype)

  def buffer_transfers(self, compressor: Compressor, n: int, sizes: Sizes,
                     dtype=jnp.float32) -> tuple[wire.Transfer, ...]:
    """:meth:`transfers` for one flat ``n``-element buffer: by default one
    collective of ``payload_kind`` per payload array."""
    if self.payload_kind is None:
      raise NotImplementedError(f"{type(self).__name__} declares no transfers")
    return wire.transfers(self.payload_kind,
                          compressor.payload_arrays(n, dtype), axes_of(sizes),
                          sizes)

  def reduce_scatter_buffer(self, compressor: Compressor, x: jax.Array,
                          key: jax.Array, axis_name: AxisName):
    """Compressed reduce-scatter of one flat ``(p * c,)`` buffer (``p``
    devices; chunk ``j`` is ``x[j * c:(j + 1) * c]``): ``(shard, local)``.

    ``shard``: float32 ``(c,)``, the mean over the axis of chunk ``j`` on
    device ``j`` (varying: each device its own chunk); ``local``: float32
    ``(p * c,)``, what this device contributed (for error feedback).

    By default phase 1 of :class:`~jaxcomp.collectives.TwoPhase`: every
    chunk is encoded on its own (chunk ``j`` with key ``fold_in(key, j)``),
    an all-to-all sends chunk ``j``'s payload to device ``j``, which decodes
    the ``p`` payloads it receives and sums them in float32 (ZeRO++'s qgZ;
    sparse payloads are each chunk's own selection, sent to its owner).
    """
    return phase_one(compressor, x, key, axis_name)

  def reduce_scatter_transfers(self, compressor: Compressor, n: int,
                               sizes: Sizes, dtype=jnp.float32
                               ) -> tuple[wire.Transfer, ...]:
    """The collectives :meth:`reduce_scatter_buffer` issues for an ``n``-element
    buffer (``n`` a multiple of the device count): one collective of
    ``reduce_scatter_kind`` (by default an all-to-all) of the ``p`` chunk
    payloads per payload array."""
    p = wire.devices(sizes)
    chunk = compressor.payload_arrays(chunk_size(n, p), dtype)
    return wire.transfers(self.reduce_scatter_kind, [p * b for b in chunk],
                          axes_of(sizes), sizes)

  def payload_bytes(self, compressor: Compressor, shapes: _parts.Shapes,
                    sizes: Sizes, dtype=jnp.float32) -> int:
    """Operand bytes one device hands to collectives for one exchange."""
    return wire.operand_bytes(self.transfers(compressor, shapes, sizes, dtype))

  def ring_bytes(self, compressor: Compressor, shapes: _parts.Shapes,
                 sizes: Sizes, dtype=jnp.float32) -> float:
    """Bytes one device sends for one exchange by the ring algorithms: what
    :attr:`jaxcomp.Traffic.ring_bytes` reads from the compiled HLO."""
    return wire.total_ring_bytes(self.transfers(compressor, shapes, sizes,
                                                dtype))


REGISTRY: Registry[Collective] = Registry("collective")
register = REGISTRY.register
names = REGISTRY.names


def _one_part(result):
  """``(mean, local, state)`` of a one-part :meth:`Collective.exchange_concatenated`
  as flat arrays (a sparse ``local`` decoded dense)."""
  (mean,), local, state = result
  return mean, _parts.concat(tuple(local)), state


@register
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
  payload_kind: ClassVar[str] = "all-reduce"
  reduce_scatter_kind: ClassVar[str] = "reduce-scatter"

  def check(self, compressor):
    super().check(compressor)
    if not compressor.linear:
      raise ValueError(
          f"collective='psum' needs a linear compressor; {compressor.name!r} "
          "is not (its payloads cannot be summed in flight). Use "
          "collective='allgather'.")

  def exchange_buffer(self, compressor, x, key, axis_name, state=()):
    n = x.shape[0]
    p = axis_size(axis_name)
    if compressor.prescale:
      payload = compressor.encode(x / p, key)
      mean = compressor.decode(lax.psum(payload, axis_name), n, key)
      local = compressor.decode(payload, n, key) * p
      return mean, local, state
    return _one_part(self.exchange_concatenated(compressor, x, (n,), key,
                                         axis_name, state))

  def exchange_concatenated(self, compressor, x, part_sizes, key, axis_name,
                     state=()):
    """As :meth:`exchange_buffer`, decoding straight into parts."""
    if compressor.prescale:
      return super().exchange_concatenated(compressor, x, part_sizes, key,
                                    axis_name, state)
    p = axis_size(axis_name)
    payload = compressor.encode(x, key)
    summed = jax.tree.map(lambda a: lax.psum(a, axis_name), payload)
    mean = compressor.decode_parts(summed, part_sizes, key)  # dense as read
    return (tuple(m / p for m in mean),
            compressor.decode_parts(payload, part_sizes, key), state)

  def reduce_scatter_buffer(self, compressor, x, key, axis_name):
    """Each chunk encoded on its own (the same chunk keys on every device),
    the ``p`` chunk payloads summed in flight by ``lax.psum_scatter``, this
    device's sum decoded: for ``identity``, exactly ``psum_scatter(x) / p``."""
    p = axis_size(axis_name)
    c = x.shape[0] // p
    chunks = x.reshape(p, c)
    keys = chunk_keys(key, 0, p)
    if compressor.prescale:
      chunks = chunks * (1.0 / p)
    payloads = jax.vmap(compressor.encode)(chunks, keys)
    me = lax.axis_index(axis_name)
    summed = jax.tree.map(
        lambda a: lax.psum_scatter(a, axis_name, scatter_dimension=0), payloads)
    shard = compressor.decode(summed, c, jax.random.fold_in(key, me))
    local = jax.vmap(lambda pl, k: compressor.decode(pl, c, k))(
        payloads, keys).reshape(-1)
    if compressor.prescale:
      return shard, local * p
    return shard / p, local


@register
@dataclasses.dataclass(frozen=True)
class AllGatherMean(Collective):
  """All-gather of every device's payload, then a local decode and sum.

  Works for every compressor. Per-device operand bytes:
  ``compressor.payload_bytes(n)``, but every device *receives* ``p - 1``
  payloads, so traffic grows linearly with the device count (Agarwal et al.
  2022): a ring moves ``(p - 1)`` times the operand bytes.
  """

  name: ClassVar[str] = "allgather"
  payload_kind: ClassVar[str] = "all-gather"

  def exchange_buffer(self, compressor, x, key, axis_name, state=()):
    return _one_part(self.exchange_concatenated(compressor, x, (x.shape[0],), key,
                                         axis_name, state))

  def exchange_concatenated(self, compressor, x, part_sizes, key, axis_name,
                     state=()):
    """Decodes straight into parts (sparse payloads scatter into each
    part's own zeros, and their ``local`` stays sparse)."""
    p = axis_size(axis_name)
    payload = compressor.encode(x, key)
    gathered = jax.tree.map(
        lambda a: lax.all_gather(a, axis_name, to="invarying"), payload)
    mean = compressor.decode_sum_parts(gathered, part_sizes, key)
    return (tuple(m / p for m in mean),
            compressor.decode_parts(payload, part_sizes, key), state)


@register
@dataclasses.dataclass(frozen=True)
class SenderMean(Collective):
  """All-gather of every device's sparse payload; each coordinate is then
  averaged over the devices that *sent* it (0 where none did), not over all
  ``p``: DeMo's mean of its DCT coefficients (Peng, Quesnelle & Kingma,
  DeMo: Decoupled Momentum Optimization <https://arxiv.org/abs/2411.19870>,
  2024). For compressors that send (value, index) pairs
  (:meth:`jaxcomp.compressors.Compressor.decode_sender_mean`: DCT top-k and
  the sparsifiers).

  Bytes as :class:`AllGatherMean`: ``compressor.payload_bytes(n)`` operand
  bytes per device, ``(p - 1)`` times that on a ring.

  Raises:
    ValueError: in :func:`jaxcomp.compressed_mean`, for a compressor whose
      payload is not (value, index) pairs.
  """

  name: ClassVar[str] = "sender_mean"
  payload_kind: ClassVar[str] = "all-gather"
  reduce_scatter: ClassVar[bool] = False

  def check(self, compressor):
    super().check(compressor)
    if (type(compressor).decode_sender_mean
        is Compressor.decode_sender_mean):
      raise ValueError(
          f"collective='sender_mean' averages (value, index) pairs by "
          f"sender; compressor {compressor.name!r} sends none: use "
          "'dct_topk' or a sparsifier ('topk', 'dgc', 'threshold')")

  def exchange_buffer(self, compressor, x, key, axis_name, state=()):
    payload = compressor.encode(x, key)
    gathered = jax.tree.map(
        lambda a: lax.all_gather(a, axis_name, to="invarying"), payload)
    n = x.shape[0]
    return (compressor.decode_sender_mean(gathered, n, key),
            compressor.decode(payload, n, key), state)


@register
@dataclasses.dataclass(frozen=True)
class OwnExchange(Collective):
  """Lets a compressor with ``own_exchange`` run its own rounds (e.g.
  PowerSGD's all-reduces of P and Q) on the bucket's tensors; its state is
  the compressor's. Registered as ``"own_exchange"``."""

  name: ClassVar[str] = "own_exchange"
  reduce_scatter: ClassVar[bool] = False

  def check(self, compressor):
    if not compressor.own_exchange:
      raise ValueError(
          f"collective='own_exchange' needs a compressor that runs its own "
          f"exchange; {compressor.name!r} does not")

  def init_state(self, compressor, shapes, key, axis_name):
    return compressor.init_state(shapes, key, axis_name)

  def exchange(self, compressor, parts, shapes, *, key, step, axis_name,
               state=()):
    return compressor.exchange(parts, shapes, key=key, step=step,
                               axis_name=axis_name, state=state)

  def transfers(self, compressor, shapes, sizes, dtype=jnp.float32):
    return compressor.transfers(shapes, sizes, dtype)

  def buffer_transfers(self, compressor, n, sizes, dtype=jnp.float32):
    return compressor.buffer_transfers(n, sizes, dtype)


def chunk_size(n: int, num_devices: int) -> int:
  """Elements per chunk when ``n`` is split into ``num_devices`` chunks
  (``ceil(n / num_devices)``; the last chunks are zero-padded)."""
  return -(-n // num_devices)


def chunk_keys(key: jax.Array, start: int, p: int) -> jax.Array:
  """Keys ``fold_in(key, start + j)`` for ``j < p``, stacked."""
  return jax.vmap(lambda i: jax.random.fold_in(key, i))(
      start + jnp.arange(p, dtype=jnp.int32))


def encode_chunks(compressor: Compressor, chunks: jax.Array,
                  keys: jax.Array):
  """The payloads of ``chunks`` (``(p, c)``) encoded with ``keys`` (``(p,)``
  keys), stacked: at once under ``jax.vmap``, or, for a compressor that is
  not :attr:`~jaxcomp.compressors.Compressor.vmappable`, one after another
  (``lax.map``)."""
  if compressor.vmappable:
    return jax.vmap(compressor.encode)(chunks, keys)
  return lax.map(lambda ck: compressor.encode(*ck), (chunks, keys))


def phase_one(compressor: Compressor, x: jax.Array, key: jax.Array,
              axis_name: AxisName):
  """Phase 1 of the two-phase exchange of a flat ``(n,)`` buffer: chunks of
  ``c = ceil(n / p)`` (zero-padded to ``p * c``) encoded with keys
  ``fold_in(key, j)``, sent to their owners by one all-to-all, decoded and
  summed there. Returns ``(chunk_mean, local)``: float32 ``(c,)``, the mean
  of this device's chunk over the axis, and float32 ``(n,)``, the decodes of
  this device's own chunk payloads."""
  n = x.shape[0]
  p = axis_size(axis_name)
  c = chunk_size(n, p)
  chunks = jnp.pad(x, (0, p * c - n)).reshape(p, c)
  keys = chunk_keys(key, 0, p)
  payloads = encode_chunks(compressor, chunks, keys)
  local = jax.vmap(lambda pl, k: compressor.decode(pl, c, k))(
      payloads, keys).reshape(-1)[:n]
  # received[i] is device i's payload for this device's chunk.
  received = jax.tree.map(lambda a: lax.all_to_all(a, axis_name, 0, 0),
                          payloads)
  me = lax.axis_index(axis_name)
  chunk_mean = compressor.decode_sum(received, c,
                                     jax.random.fold_in(key, me)) / p
  return chunk_mean, local


def default_for(compressor: Compressor) -> Collective:
  """The collective :func:`jaxcomp.compressed_mean` uses when none is given:
  the one the compressor names in its ``default_collective`` attribute (see
  :attr:`jaxcomp.compressors.Compressor.default_collective`)."""
  return REGISTRY.lookup(compressor.default_collective)()


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
  else:
    coll = REGISTRY.lookup(collective)()
  coll.check(compressor)
  if axis_name is not None:
    coll = coll.bind_axes(axis_name)
  return coll
