"""What one bucket's exchange costs: the compressors the model prices, their
encode/decode time, and the transfers of the collective that carries them.

Linear compressors (``compressor.linear``) are summed in flight by an
all-reduce of their payload and decoded once; the others are exchanged with an
all-gather (or jaxcomp's two-phase all-reduce, see :func:`default_collective`)
and every worker decodes all ``p`` payloads (Agarwal et al. 2022:
the all-gather cost and the decode both grow with ``p``). With error feedback
each worker also decodes its own payload to update the residual.

A bucket of ``n`` float32 elements is priced as the transfers
(:class:`jaxcomp.wire.Transfer`) that its library collective lists for it
(:func:`bucket_transfers`), each timed by :mod:`jaxcomp.perfmodel.costs`'
alpha-beta formulas, plus its encode and decode (:class:`CodecCost`), for
the outputs ``"mean"``, ``"shard"`` and ``"hsdp"`` (:func:`bucket_comm`,
:func:`bucket_codec`). :mod:`jaxcomp.perfmodel.timeline` places these costs
on a step's two streams.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol, cast, runtime_checkable
from collections.abc import Mapping

from jaxcomp.perfmodel import costs
from jaxcomp import collectives
from jaxcomp import wire
from jaxcomp.collectives import base as _collectives
from jaxcomp.compressors import base as _compressors
from jaxcomp._mesh import AxisName

# The public names; Pricing, exchange_pricing, bucket_comm, bucket_codec,
# transfers_of, comm_kind and OUTPUTS serve
# the modules timeline and prediction.
__all__ = [
    "PricedCompressor",
    "DenseCompressor",
    "IdealCompressor",
    "DeMoCompressor",
    "CodecCost",
    "default_collective",
    "bucket_transfers",
]


@runtime_checkable
class PricedCompressor(Protocol):
  """What the model needs from a compressor that is not one of
  ``jaxcomp.compressors`` (:class:`DenseCompressor`, :class:`IdealCompressor`,
  a hypothetical one).

  ``payload_bytes(n)``: bytes one worker puts on the wire for an ``n``-element
  float32 buffer. ``linear``: True when payloads can be summed by an
  all-reduce. The library's compressors are priced through their own
  collectives' transfers instead (:func:`bucket_transfers`).
  """

  linear: bool

  def payload_bytes(self, n: int) -> int:
    ...


@dataclasses.dataclass(frozen=True)
class DenseCompressor:
  """The dense baseline: the float32 gradient itself, summed by all-reduce."""

  linear: bool = True
  bytes_per_element: int = 4

  def payload_bytes(self, n: int) -> int:
    return self.bytes_per_element * int(n)


@dataclasses.dataclass(frozen=True)
class IdealCompressor:
  """A hypothetical linear compressor with ratio ``ratio`` and free encode/decode.

  Used to ask how much compression a link needs (Zhang et al. 2020).
  """

  ratio: float
  linear: bool = True

  def __post_init__(self):
    if not self.ratio >= 1:
      raise ValueError(f"ratio must be >= 1, got {self.ratio=}")

  def payload_bytes(self, n: int) -> float:
    return 4.0 * int(n) / self.ratio


def DeMoCompressor(compression_topk: int = 32,  # noqa: N802 (it stands for a class)
                   compression_chunk: int = 64):
  """:func:`jaxcomp.demo`'s exchange, for the model: the ``"dct_topk"``
  compressor (:class:`jaxcomp.compressors.DCTTopK`) it sends through, every
  step, per tensor: the ``compression_topk`` largest DCT coefficients of each
  ``compression_chunk`` x ``compression_chunk`` chunk of the momentum,
  all-gathered as float32 values and int32 indices (two messages).

  The model sees flat buffers, not shapes: an ``n``-element buffer counts
  as ``ceil(n / chunk**2)`` full chunks (the compressor unbound to a shape),
  exact for matrices whose sides are multiples of the chunk (DeMo's chunk is
  the largest divisor of a side up to ``compression_chunk``, so other shapes
  send more; 1-D tensors are cut into ``1 x chunk`` chunks and send
  ``topk / chunk`` of themselves). :func:`jaxcomp.lowcomm.demo_bytes`
  counts a model's exact bytes from its shapes.

  Raises:
    ValueError: ``compression_topk`` or ``compression_chunk`` not an integer
      >= 1.

  Reference: Peng, Quesnelle & Kingma, DeMo: Decoupled Momentum
  Optimization <https://arxiv.org/abs/2411.19870>, 2024 (defaults: topk
  32, chunk 64, from the reference implementation).
  """
  for name, v in (("compression_topk", compression_topk),
                  ("compression_chunk", compression_chunk)):
    if isinstance(v, bool) or not isinstance(v, int) or v < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
  return _compressors.get("dct_topk", topk=compression_topk,
                          chunk=compression_chunk)


@dataclasses.dataclass(frozen=True)
class CodecCost:
  """Encode/decode time of a compressor, affine in the buffer size.

  ``encode(n) = encode_fixed + encode_per_element·n`` seconds, likewise decode.
  Fit on the user's device by :func:`jaxcomp.perfmodel.measure_codec`.
  """

  encode_fixed: float = 0.0
  encode_per_element: float = 0.0
  decode_fixed: float = 0.0
  decode_per_element: float = 0.0
  device: str = ""

  def encode(self, n: int) -> float:
    return self.encode_fixed + self.encode_per_element * n

  def decode(self, n: int) -> float:
    return self.decode_fixed + self.decode_per_element * n

  def to_dict(self) -> dict:
    return dataclasses.asdict(self)

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> CodecCost:
    fields = {f.name for f in dataclasses.fields(cls)}
    unknown = set(d) - fields
    if unknown:
      raise ValueError(f"unknown CodecCost fields {sorted(unknown)}; expected {sorted(fields)}")
    return cls(**d)


# The collectives a prediction may be forced to, by jaxcomp.collectives' names.
_COLLECTIVE_CHOICES = ("psum", "allgather", "two_phase", "auto")


def _is_library(compressor) -> bool:
  return isinstance(compressor, _compressors.Compressor)


@dataclasses.dataclass(frozen=True)
class _Arrays:
  """A :class:`PricedCompressor` seen through the library compressor's
  ``payload_arrays``, which the collectives' transfers read: its payload as
  one array, plus empty ones up to ``arrays`` (each a message of its own)."""

  priced: Any
  arrays: int = 1
  own_exchange = False

  def payload_arrays(self, n: int, dtype=None) -> tuple[int, ...]:
    del dtype  # a PricedCompressor states float32 buffers
    return (self.priced.payload_bytes(n),) + (0,) * (self.arrays - 1)


def default_collective(compressor) -> str:
  """The collective :func:`jaxcomp.compressed_mean` uses by default for
  ``compressor``, by its name in :mod:`jaxcomp.collectives`: what a jaxcomp
  compressor names (``Compressor.default_collective``: ``"psum"``,
  ``"allgather"``, ``"auto"``, ``"own_exchange"``, ...); for a
  :class:`PricedCompressor`, ``"psum"`` (all-reduced) when linear, else
  ``"allgather"``.
  """
  if _is_library(compressor):
    return compressor.default_collective
  return "psum" if compressor.linear else "allgather"


def comm_kind(compressor, collective: str | None) -> str:
  if collective is None:
    return default_collective(compressor)
  if collective not in _COLLECTIVE_CHOICES:
    raise ValueError(f"collective must be one of {_COLLECTIVE_CHOICES}, got {collective!r}")
  if getattr(compressor, "own_exchange", False):
    raise ValueError(f"compressor {compressor.name!r} runs its own exchange; leave "
                     f"collective=None, not {collective!r}")
  if collective in ("two_phase", "auto") and compressor.linear:
    raise ValueError(f"collective={collective!r} is for compressors that are not linear "
                     "(linear ones are summed by an all-reduce)")
  return collective


def _library_collective(compressor, kind: str):
  """jaxcomp.collectives' collective for ``kind`` (unchecked: the model may
  price an all-reduce of payloads that the library would refuse to sum)."""
  if getattr(compressor, "own_exchange", False):
    return _collectives.OwnExchange()
  return _collectives.REGISTRY.lookup(kind)()


def bucket_transfers(compressor, n: int, workers: int, *, collective: str | None = None,
                     messages_per_bucket: int | None = None) -> tuple:
  """The collectives one ``n``-element float32 bucket's exchange issues per
  worker, as the library's collective lists them
  (:meth:`jaxcomp.collectives.Collective.buffer_transfers`; for ``"auto"``, the
  one :meth:`jaxcomp.collectives.Auto.pick` takes). :func:`predict` prices
  exactly these.

  Args:
    compressor: a ``jaxcomp.compressors`` compressor (its payload arrays,
      each a collective of its own) or a :class:`PricedCompressor` (one
      array of ``payload_bytes(n)`` bytes, plus ``messages_per_bucket - 1``
      empty ones).
    n: elements of the bucket.
    workers: devices in the collectives' group.
    collective: as for :func:`predict`.
    messages_per_bucket: for a :class:`PricedCompressor` only.

  Returns:
    A tuple of :class:`jaxcomp.wire.Transfer`.

  Raises:
    ValueError: ``messages_per_bucket`` is not an integer >= 1 or is given
      with a library compressor; ``collective`` does not fit the compressor.
  """
  kind = comm_kind(compressor, collective)
  c = _payload_view(compressor, messages_per_bucket)
  return _library_collective(compressor, kind).buffer_transfers(c, n, {"data": workers})


def _payload_view(compressor, messages_per_bucket) -> _compressors.Compressor:
  if _is_library(compressor) or (hasattr(compressor, "payload_arrays")
                                 and messages_per_bucket is None):
    if messages_per_bucket is not None:
      raise ValueError(
          "messages_per_bucket is for compressors outside jaxcomp.compressors: a "
          f"library compressor ({compressor.name!r}) declares its payload arrays")
    return compressor
  m = 1 if messages_per_bucket is None else messages_per_bucket
  if isinstance(m, bool) or not isinstance(m, int) or m < 1:
    raise ValueError(f"messages_per_bucket must be an integer >= 1, got {messages_per_bucket!r}")
  # Duck-typed: it has the payload hooks the collectives read.
  return cast(_compressors.Compressor, _Arrays(compressor, m))


# predict's output layouts (the islands ones are priced as their "mean" or
# "shard" parts, in jaxcomp.perfmodel.prediction).
OUTPUTS = ("mean", "shard", "hsdp", "islands", "islands_fsdp")


@dataclasses.dataclass(frozen=True)
class Pricing:
  """What prices one bucket's exchange in :func:`predict` (output ``"mean"``,
  ``"shard"`` or ``"hsdp"``).

  Attributes:
    compressor: as passed to :func:`predict`.
    payload: the compressor as the collectives read it (:func:`_payload_view`).
    library: the library collective for the bucket's kind.
    network: the whole network (``p = network.workers``).
    output: ``"mean"``, ``"shard"`` or ``"hsdp"``.
    group: the axis sizes the collectives are asked for.
    nets: HSDP's networks by axis name (``"devices"``, ``"hosts"``); empty
      otherwise (every transfer runs on ``network``).
    codec: encode/decode cost.
    error_feedback: whether each worker also decodes its own payloads.
    cache: each bucket size's transfers, read for its time, codec and bytes.
  """

  compressor: Any
  payload: _compressors.Compressor
  library: Any
  network: costs.Network
  output: str
  group: dict[str, int]
  nets: dict[AxisName, costs.Network]
  codec: CodecCost
  error_feedback: bool
  cache: dict[int, tuple] = dataclasses.field(default_factory=dict)


def exchange_pricing(compressor, network: costs.Network, kind: str, *, codec: CodecCost,
                     output: str, error_feedback: bool | None,
                     messages_per_bucket: int | None) -> Pricing:
  """Checks ``output`` against the compressor and network and builds its :class:`Pricing`."""
  payload = _payload_view(compressor, messages_per_bucket)
  library = _library_collective(compressor, kind)
  group = {"data": network.workers}
  if output not in OUTPUTS:
    raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
  if output == "shard" and not library.reduce_scatter:
    raise ValueError(f"output='shard' cannot use {compressor.name!r}: it runs its "
                     "own exchange of whole tensors")
  nets: dict[AxisName, costs.Network] = {}
  if output == "hsdp":
    nets = _hsdp_networks(network)
    group = {"hosts": nets["hosts"].workers}  # what _resolved() picks for
  if error_feedback is None:
    error_feedback = bool(getattr(compressor, "biased", False))
  return Pricing(compressor, payload, library, network, output, group, nets,
                  codec, error_feedback)


def _hsdp_networks(network: costs.Network) -> dict[AxisName, costs.Network]:
  """HSDP's networks: ``"devices"`` inside a node, ``"hosts"`` across nodes."""
  if network.algorithm != "hierarchical":
    raise ValueError(
        "output='hsdp' shards inside a node and replicates across nodes: pass "
        "Network(workers, link, algorithm='hierarchical', workers_per_node=g, "
        "intra=Link(...))")
  g = network.workers_per_node
  hosts = network.workers // g
  assert network.intra is not None  # Network checks it for "hierarchical"
  # The g devices of a node exchange their shards across nodes at once,
  # through the node's one link: each sees 1/g of its bandwidth.
  return {"devices": costs.Network(g, network.intra),
          "hosts": costs.Network(hosts, costs.Link(network.link.alpha,
                                                   network.link.beta * g))}


def _resolved(pricing: Pricing, n: int):
  """The collective that carries an ``n``-element bucket."""
  if isinstance(pricing.library, collectives.Auto):
    return pricing.library.pick(pricing.payload, n, wire.devices(pricing.group))
  return pricing.library


def _shard_of(pricing: Pricing, n: int) -> int:
  """HSDP: elements of a device's shard of an ``n``-element bucket."""
  return collectives.chunk_size(n, pricing.nets["devices"].workers)


def transfers_of(pricing: Pricing, n: int) -> tuple:
  """The transfers of an ``n``-element bucket's exchange (cached per size)."""
  if n not in pricing.cache:
    pricing.cache[n] = _exchange_transfers(pricing, n)
  return pricing.cache[n]


def _exchange_transfers(pricing: Pricing, n: int) -> tuple:
  """The transfers of an ``n``-element bucket's exchange, by ``pricing.output``."""
  payload, group = pricing.payload, pricing.group
  if pricing.output == "shard":
    p = pricing.network.workers
    n = p * collectives.chunk_size(n, p)
    return pricing.library.reduce_scatter_transfers(payload, n, group)
  if pricing.output == "hsdp":
    # The exact float32 reduce-scatter inside the node, then the shard's
    # compressed mean across nodes.
    g, c = pricing.nets["devices"].workers, _shard_of(pricing, n)
    inside = wire.transfers("reduce-scatter", [4 * g * c], "devices",
                            {"devices": g}) if g > 1 else ()
    # The shards are 1-D: a library compressor that treats shapes apart
    # (PowerSGD without view="flat") is priced on a 1-D bucket.
    across = (_resolved(pricing, c).transfers(payload, ((c,),), group)
              if _is_library(pricing.compressor)
              else _resolved(pricing, c).buffer_transfers(payload, c, group))
    return inside + tuple(across)
  return _resolved(pricing, n).buffer_transfers(payload, n, group)


def bucket_comm(pricing: Pricing, n: int) -> float:
  """Seconds of an ``n``-element bucket's collectives."""
  return sum(costs.transfer_time(t, pricing.nets.get(t.axis_name, pricing.network))
             for t in transfers_of(pricing, n))


def bucket_codec(pricing: Pricing, n: int) -> tuple[float, float]:
  """(encode before the exchange, decode work after it), seconds."""
  if pricing.output == "hsdp":
    # The shard's compressed mean across the nodes (the exact
    # reduce-scatter inside the node has no codec).
    return _mean_codec(pricing, _shard_of(pricing, n), pricing.nets["hosts"].workers,
                       [t for t in transfers_of(pricing, n) if t.axis_name == "hosts"])
  p, codec = pricing.network.workers, pricing.codec
  if pricing.output == "shard":
    c = collectives.chunk_size(n, p)
    summed = all(t.kind == "reduce-scatter" for t in transfers_of(pricing, n))
    # p chunk encodes; the owner decodes its chunk's p payloads (one sum
    # for a reduce-scatter), and error feedback the p own chunk payloads.
    dec = (1 if summed else p) + (p if pricing.error_feedback else 0)
    return p * codec.encode(c), dec * codec.decode(c)
  return _mean_codec(pricing, n, p, transfers_of(pricing, n))


def _mean_codec(pricing: Pricing, n: int, workers: int, ts) -> tuple[float, float]:
  """The codec of an ``n``-element bucket's mean over ``workers`` by its
  collective, whose transfers are ``ts``."""
  codec, error_feedback = pricing.codec, pricing.error_feedback
  if isinstance(_resolved(pricing, n), collectives.TwoPhase):
    c = collectives.chunk_size(n, workers)
    # p chunk encodes; then p chunk decodes, one re-encode, p decodes of
    # the gathered chunks, and (error feedback) the p own chunk payloads.
    dec = ((2 * workers + (workers if error_feedback else 0)) * codec.decode(c)
           + codec.encode(c))
    return workers * codec.encode(c), dec
  summed = all(t.kind == "all-reduce" for t in ts)
  decodes = (1 if summed else workers) + (1 if error_feedback else 0)
  return codec.encode(n), decodes * codec.decode(n)
