"""Step-time model of compressed data-parallel training.

One training step on each of ``p`` workers is modelled as two streams:

* the **compute stream** runs the forward pass, the backward pass layer by layer
  from the output towards the input, the compressor's *encode* of each bucket as
  soon as the bucket's last gradient exists, the *decode* of each bucket once its
  communication has arrived, and the optimizer update;
* the **network** carries one bucket at a time, in order: a bucket's collective
  starts at ``max(its encode has finished, the previous bucket's collective has
  finished)`` (wait-free backpropagation, WFBP; Zhang et al. 2017, Shi et al.
  2019). With ``overlap="after_backward"`` (or False) no collective starts
  before the backward pass has finished; with ``overlap="serial"`` nothing
  overlaps at all (a runtime that runs collectives synchronously on the
  compute thread, such as XLA:CPU).

Linear compressors (``compressor.linear``) are summed in flight by an
all-reduce of their payload and decoded once; the others are exchanged with an
all-gather (or jaxcomp's two-phase all-reduce, see :func:`default_collective`)
and every worker decodes all ``p`` payloads (Agarwal et al. 2022:
the all-gather cost and the decode both grow with ``p``). With error feedback
each worker also decodes its own payload to update the residual.

The outputs (:class:`Prediction`): step time, communication time (sum of the
collectives), exposed communication (step time minus compute-stream busy
time), scaling factor (throughput of ``p`` workers over ``p`` times one
worker's: ``T_1 / T_p`` with ``T_1`` = forward + backward + update) and
speedup over dense (uncompressed float32 all-reduce with the same buckets).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings
from typing import Any, Protocol, cast, runtime_checkable
from collections.abc import Callable, Mapping, Sequence

from jaxcomp.perfmodel import costs
from jaxcomp import bucketing
from jaxcomp import collectives
from jaxcomp import wire
from jaxcomp.collectives import base as _collectives
from jaxcomp.compressors import base as _compressors
from jaxcomp._mesh import AxisName

__all__ = [
    "PricedCompressor",
    "ModelProfile",
    "CodecCost",
    "Prediction",
    "DenseCompressor",
    "IdealCompressor",
    "predict",
    "compare",
    "default_collective",
    "bucket_plan",
    "save_profile",
    "load_profile_file",
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


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """Gradient sizes and compute times of one model on one device.

  Attributes:
    name: label.
    layer_sizes: elements of each gradient tensor (float32), in forward order
      (index 0 is used first in the forward pass; its gradient is ready last).
    backward_times: seconds of backward pass attributed to each tensor, same
      order. The backward pass runs from the last index to index 0.
    forward_time: seconds of the forward pass (and loss).
    update_time: seconds of the optimizer update after the exchange.
    meta: free-form description (device, batch, how it was measured).
  """

  name: str
  layer_sizes: tuple[int, ...]
  backward_times: tuple[float, ...]
  forward_time: float
  update_time: float = 0.0
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "layer_sizes", tuple(int(n) for n in self.layer_sizes))
    object.__setattr__(self, "backward_times", tuple(float(t) for t in self.backward_times))
    if not self.layer_sizes:
      raise ValueError("a profile needs at least one layer")
    if len(self.layer_sizes) != len(self.backward_times):
      raise ValueError(
          f"layer_sizes and backward_times differ in length: "
          f"{len(self.layer_sizes)} != {len(self.backward_times)}")
    if any(n < 0 for n in self.layer_sizes):
      raise ValueError("layer_sizes must be >= 0 elements")
    if any(not (t >= 0 and math.isfinite(t)) for t in self.backward_times):
      raise ValueError("backward_times must be finite seconds >= 0")
    if not (self.forward_time >= 0 and self.update_time >= 0):
      raise ValueError(f"forward_time and update_time must be >= 0, got "
                       f"{self.forward_time=}, {self.update_time=}")

  @property
  def num_params(self) -> int:
    return sum(self.layer_sizes)

  @property
  def backward_time(self) -> float:
    return sum(self.backward_times)

  @property
  def compute_time(self) -> float:
    """One worker's step without communication (forward + backward + update), seconds."""
    return self.forward_time + self.backward_time + self.update_time

  def scaled(self, factor: float) -> ModelProfile:
    """The same model on a device ``factor`` times slower (times multiplied)."""
    return dataclasses.replace(
        self,
        backward_times=tuple(t * factor for t in self.backward_times),
        forward_time=self.forward_time * factor,
        update_time=self.update_time * factor)

  def tensor_parallel(self, degree: int) -> ModelProfile:
    """The model as each device of a tensor-parallel group of ``degree``
    devices holds it (Megatron-LM's layout, the ``tensor`` axis of
    MaxText's ``(data, fsdp, tensor)`` mesh): every gradient tensor split
    ``degree`` ways (``ceil(n / degree)`` elements per device) and the
    compute times divided by ``degree``. The data-parallel exchange
    (replicated, ``"shard"``, ``"hsdp"``) then prices one device's shard of
    every tensor, as :class:`jaxcomp.CompressedValueAndGrad` compresses it.

    The tensor axis's own collectives (the activations' all-reduces inside
    the forward and backward passes, the same with and without
    compression) are not priced: the real step is longer by them, so the
    share of the step that compression can save is smaller than predicted
    (an upper bound on its speedup). Tensors that are replicated over the
    tensor axis (norm scales, biases) are split too.

    Args:
      degree: devices in the tensor-parallel group, an integer >= 1.

    Raises:
      ValueError: ``degree`` is not an integer >= 1.

    Example:
      >>> from jaxcomp import perfmodel
      >>> p = perfmodel.ModelProfile("mlp", (1000, 10), (2e-3, 1e-4), 1e-3)
      >>> tp = p.tensor_parallel(4)
      >>> tp.layer_sizes, round(tp.compute_time * 1e3, 3)
      ((250, 3), 0.775)
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
      raise ValueError(f"degree (tensor parallelism) must be an integer >= 1, "
                       f"got {degree!r}")
    if degree == 1:
      return self
    return dataclasses.replace(
        self, name=f"{self.name} / tensor {degree}",
        layer_sizes=tuple(-(-n // degree) for n in self.layer_sizes),
        backward_times=tuple(t / degree for t in self.backward_times),
        forward_time=self.forward_time / degree,
        update_time=self.update_time / degree,
        meta={**self.meta, "tensor_parallel": degree})

  def to_dict(self) -> dict:
    return {
        "name": self.name,
        "layer_sizes": list(self.layer_sizes),
        "backward_times": list(self.backward_times),
        "forward_time": self.forward_time,
        "update_time": self.update_time,
        "meta": dict(self.meta),
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelProfile:
    missing = {"name", "layer_sizes", "backward_times", "forward_time"} - set(d)
    if missing:
      raise ValueError(f"profile is missing fields {sorted(missing)}")
    return cls(name=d["name"], layer_sizes=d["layer_sizes"],
               backward_times=d["backward_times"], forward_time=d["forward_time"],
               update_time=d.get("update_time", 0.0), meta=d.get("meta", {}))


def save_profile(profile: ModelProfile, path: str | os.PathLike) -> None:
  """Writes ``profile`` as JSON (read back by :func:`load_profile_file`)."""
  with open(path, "w") as f:
    json.dump(profile.to_dict(), f, indent=1)


def load_profile_file(path: str | os.PathLike) -> ModelProfile:
  """Reads a profile written by :func:`save_profile`.

  Raises:
    FileNotFoundError: no such file.
    ValueError: the file is not a profile.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"profile file {os.fspath(path)!r} does not exist")
  with open(path) as f:
    try:
      d = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"profile file {os.fspath(path)!r} is not JSON: {e}") from None
  if not isinstance(d, dict):
    raise ValueError(f"profile file {os.fspath(path)!r} does not hold a JSON object")
  return ModelProfile.from_dict(d)


@dataclasses.dataclass(frozen=True)
class Prediction:
  """Predicted timings of one training step, seconds."""

  step_time: float
  comm_time: float
  exposed_comm: float
  compute_time: float  # busy time of the compute stream (incl. encode/decode)
  codec_time: float  # encode + decode part of compute_time
  scaling_factor: float  # T_1 / T_p
  bytes_per_worker: float  # payload bytes each worker sends into collectives
  num_buckets: int
  collective: str = ""  # the library collective priced (jaxcomp.collectives'
  #                       name: psum, allgather, two_phase, auto, own_exchange, ...)
  speedup: float = float("nan")  # over dense; set by compare()


# The collectives a prediction may be forced to, by jaxcomp.collectives' names.
_COLLECTIVE_CHOICES = ("psum", "allgather", "two_phase", "auto")
_OVERLAP_MODES = ("wfbp", "after_backward", "serial")


def _overlap_mode(overlap) -> str:
  if overlap is True:
    return "wfbp"
  if overlap is False:
    return "after_backward"
  if overlap in _OVERLAP_MODES:
    return overlap
  raise ValueError(f"overlap must be True, False or one of {_OVERLAP_MODES}, got {overlap!r}")


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


def _collective_name(collective: str) -> str:
  """``collective`` by its library name (``"allreduce"``, this model's
  earlier name for ``"psum"``, warns)."""
  if collective == "allreduce":
    warnings.warn("collective='allreduce' is deprecated: the perf model names "
                  "collectives as jaxcomp.collectives does ('psum')",
                  DeprecationWarning, stacklevel=4)
    return "psum"
  return collective


def _comm_kind(compressor, collective: str | None) -> str:
  if collective is None:
    return default_collective(compressor)
  collective = _collective_name(collective)
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
  kind = _comm_kind(compressor, collective)
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


def bucket_plan(plan, profile: ModelProfile, *, comm_time: Callable[[float], float] | None = None,
                alpha: float = 0.0, beta: float = 0.0) -> list[list[int]]:
  """Resolves a bucket plan to lists of layer indices in communication order.

  Args:
    plan: ``"layer"`` (one bucket per tensor), ``"auto"``
      (``compressed_mean``'s default ``bucketing="auto"``: a tensor of at
      least :data:`jaxcomp.bucketing.DEFAULT_BUCKET_BYTES` alone, the
      smaller ones packed together, that bucket last), ``"single"`` (one
      bucket),
      ``"mgwfbp"`` (:func:`jaxcomp.perfmodel.mgwfbp_plan` with ``comm_time`` or
      ``alpha``/``beta``), a number (fixed-size buckets of at least that many
      bytes, as in PyTorch DDP / Horovod fusion), or an explicit list of
      buckets, each a list of consecutive layer indices, the bucket holding the
      last layer first.
    profile: the model.

  Raises:
    ValueError: the plan does not cover every layer exactly once in backward order.
  """
  L = len(profile.layer_sizes)
  if isinstance(plan, str):
    if plan == "layer":
      return [[i] for i in reversed(range(L))]
    if plan == "single":
      return [list(range(L))]
    if plan == "auto":  # planned in forward (leaf) order, as the library
      limit = -(-bucketing.DEFAULT_BUCKET_BYTES // bucketing.BUFFER_ITEMSIZE)
      merged = bucketing.merge_small(range(L), list(profile.layer_sizes), limit)
      large = lambda b: profile.layer_sizes[b[0]] >= limit  # noqa: E731
      # The large tensors in backward order; a bucket of small ones packed
      # from across the model is ready when the backward pass ends.
      return ([list(b) for b in reversed(merged) if large(b)]
              + [list(b) for b in merged if not large(b)])
    if plan == "mgwfbp":
      return bucketing.mgwfbp_plan([4 * n for n in profile.layer_sizes], profile.backward_times,
                                 alpha, beta, comm_time=comm_time)
    raise ValueError(f"unknown bucket plan {plan!r}; expected 'layer', 'auto', 'single', 'mgwfbp', "
                     "a bucket size in bytes, or a list of buckets")
  if isinstance(plan, (int, float)) and not isinstance(plan, bool):
    if not plan > 0:
      raise ValueError(f"bucket size must be > 0 bytes, got {plan!r}")
    return [sorted(b) for b in bucketing.fill(
        list(reversed(range(L))), [4 * n for n in profile.layer_sizes], plan)]
  # What the checks above leave: a list of buckets (or a bool, which fails
  # here).
  buckets = [sorted(int(i) for i in b) for b in cast(Sequence, plan)]
  order = [i for b in buckets for i in sorted(b, reverse=True)]
  if order != list(reversed(range(L))) or any(not b for b in buckets):
    raise ValueError(
        f"bucket plan must cover layers {L - 1}..0 once each, in backward order, with "
        f"consecutive non-empty buckets; got {plan!r}")
  return buckets


OUTPUTS = ("mean", "shard", "hsdp", "islands", "islands_fsdp")


def _islands(profile: ModelProfile, compressor, network: costs.Network, *,
             sharded: bool, sync_every: int, buckets, overlap, **kw
             ) -> Prediction:
  """:func:`predict` for ``output="islands"`` / ``"islands_fsdp"``: the
  island's own step plus ``1 / H`` of the sync across islands."""
  if network.algorithm != "hierarchical" or network.intra is None:
    raise ValueError(
        "output='islands' trains data-parallel inside each island and "
        "syncs across islands: pass Network(workers, link, "
        "algorithm='hierarchical', workers_per_node=<devices per island>, "
        "intra=Link(...))")
  g = network.workers_per_node
  hosts = network.workers // g
  inner = predict(profile, DenseCompressor(), costs.Network(g, network.intra),
                  buckets=buckets, overlap=overlap,
                  output="shard" if sharded else "mean")
  # What one device exchanges at a sync: the whole pseudo-gradient, or its
  # shard of every tensor; the g devices of an island share its link.
  sizes = (tuple(collectives.chunk_size(n, g) for n in profile.layer_sizes)
           if sharded else profile.layer_sizes)
  exchanged = ModelProfile(f"{profile.name} (sync)", sizes,
                           (0.0,) * len(sizes), 0.0)
  across = costs.Network(hosts, costs.Link(network.link.alpha,
                                           network.link.beta * g))
  sync = predict(exchanged, compressor, across, buckets=buckets,
                 overlap="serial", **kw)
  h = sync_every
  t = inner.step_time + sync.step_time / h
  return Prediction(
      step_time=t,
      comm_time=inner.comm_time + sync.comm_time / h,
      exposed_comm=inner.exposed_comm + (sync.step_time - sync.codec_time) / h,
      compute_time=inner.compute_time + sync.codec_time / h,
      codec_time=inner.codec_time + sync.codec_time / h,
      scaling_factor=profile.compute_time / t if t > 0 else 1.0,
      bytes_per_worker=inner.bytes_per_worker + sync.bytes_per_worker / h,
      num_buckets=sync.num_buckets, collective=sync.collective)


def predict(profile: ModelProfile, compressor, network: costs.Network, *,
            codec: CodecCost | None = None, buckets="layer", overlap: bool | str = True,
            collective: str | None = None, error_feedback: bool | None = None,
            messages_per_bucket: int | None = None, output: str = "mean",
            sync_every: int = 1) -> Prediction:
  """Predicts one training step of ``profile`` with ``compressor`` on ``network``.

  Args:
    profile: gradient sizes and compute times.
    compressor: a ``jaxcomp.compressors`` compressor (priced by the
      transfers its collective lists, :func:`bucket_transfers`) or a
      :class:`PricedCompressor` (:class:`DenseCompressor`, ...).
    network: workers, links, ring or hierarchical.
    codec: encode/decode cost on this device; ``None`` means free.
    buckets: bucket plan, see :func:`bucket_plan` (``"mgwfbp"`` plans with this
      compressor's own communication cost).
    overlap: what runs at the same time as what. ``True`` or ``"wfbp"``: a
      bucket's collective starts as soon as its gradient is encoded and
      overlaps the rest of the backward pass (wait-free backpropagation);
      ``False`` or ``"after_backward"``: collectives start when the backward
      pass has finished, but a bucket's decode still overlaps the next
      buckets' collectives; ``"serial"``: nothing overlaps, the step is the
      sum of compute, encode, collectives and decode (a runtime that runs
      collectives synchronously on the compute thread, such as XLA:CPU).
    collective: None: the collective jaxcomp uses by default
      (:func:`default_collective`); or force ``"psum"`` or
      ``"allgather"``; or, for compressors that are not linear,
      ``"two_phase"`` (:class:`jaxcomp.collectives.TwoPhase`: an
      all-to-all of ``p`` chunk payloads of ``ceil(n / p)`` elements, a
      decode-sum, a re-encode, an all-gather of one chunk payload) or
      ``"auto"`` (per bucket the cheaper of the two, as
      :class:`jaxcomp.collectives.Auto` picks).
    error_feedback: whether the worker also decodes its own payload to keep
      the residual (one more decode per bucket); default ``compressor.biased``
      (jaxcomp.compressed_mean's default), False where it has no such attribute.
    messages_per_bucket: for a :class:`PricedCompressor` only: arrays per
      payload (a payload of several arrays, e.g. top-k's values and indices,
      travels as one collective each, per phase for two-phase); each extra
      array adds the collectives' start-up cost. A library compressor's
      buckets are priced by the transfers its collective lists
      (:func:`bucket_transfers`), one per payload array.
    output: ``"mean"`` (replicated data parallelism: every bucket
      all-reduced or exchanged whole) or ``"shard"`` (FSDP,
      ``compressed_mean(output="shard")``: each bucket reduce-scattered as
      ``Collective.reduce_scatter_transfers`` lists, and the parameters
      all-gathered in float32 before the forward pass, not overlapped; each
      device decodes the ``p`` payloads of its chunk), or ``"hsdp"``
      (hybrid sharding on a hierarchical ``network`` of ``g =
      workers_per_node``: parameters sharded over a node's ``g`` devices and
      all-gathered in float32 over ``intra`` before the forward pass; each
      bucket reduce-scattered exactly in float32 inside the node, then
      each device's ``ceil(n / g)``-element shard averaged across the
      ``workers / g`` nodes with ``compressor``'s collective over ``link``,
      the ``g`` devices of a node sharing it; as
      ``chain(compressed_mean("identity", "devices", output="shard"),
      compressed_mean(compressor, "hosts"))`` runs).
      ``"islands"`` (DiLoCo across islands, :func:`jaxcomp.lowcomm.init`
      with ``copies_over``, on a hierarchical ``network`` of ``g =
      workers_per_node`` devices per island): every step an exact float32
      all-reduce of the gradient inside the island over ``intra`` (with
      ``buckets`` and ``overlap``), and every ``sync_every`` steps each of
      the ``g`` devices exchanges the whole pseudo-gradient with its
      counterparts in the other islands, compressed, the ``g`` devices of
      an island sharing its ``link``; ``"islands_fsdp"`` (FSDP inside each
      island, :func:`jaxcomp.fsdp.init` with ``copies_over``): the
      parameters all-gathered and the gradient reduce-scattered inside the
      island every step, and at a sync each device exchanges only its
      ``ceil(n / g)``-element shard of every tensor.
    sync_every: DiLoCo's ``H`` (:func:`jaxcomp.diloco`): the exchange (of
      the pseudo-gradient, the parameters' size) runs once every ``H``
      steps, after that step's local update, overlapping nothing; the
      prediction is the average step: compute plus ``1 / H`` of that
      exchange's communication and codec time (and bytes). Streaming
      DiLoCo's fragments send ``1 / F`` of it ``F`` times as often: the
      same average.

  Returns:
    A :class:`Prediction` (``speedup`` is NaN; :func:`compare` fills it).
  """
  _check_network_and_sync(network, sync_every)
  if output in ("islands", "islands_fsdp"):
    return _islands(profile, compressor, network, codec=codec, buckets=buckets,
                    overlap=overlap, collective=collective,
                    error_feedback=error_feedback,
                    messages_per_bucket=messages_per_bucket,
                    sharded=output == "islands_fsdp", sync_every=sync_every)
  if sync_every > 1:
    return _diloco(profile, compressor, network, codec=codec, buckets=buckets,
                   collective=collective, error_feedback=error_feedback,
                   messages_per_bucket=messages_per_bucket, output=output,
                   sync_every=sync_every)
  mode = _overlap_mode(overlap)
  kind = _comm_kind(compressor, collective)
  pricing = _pricing(compressor, network, kind, codec=codec or CodecCost(),
                     output=output, error_feedback=error_feedback,
                     messages_per_bucket=messages_per_bucket)
  plan = bucket_plan(buckets, profile,
                     comm_time=lambda nbytes: _bucket_comm(pricing, int(nbytes) // 4))
  line = _forward(pricing, profile)
  _backward(pricing, profile, plan, mode, line)
  _decode_arrivals(line, mode)
  line.t += profile.update_time
  return _prediction(profile, line, num_buckets=len(plan), collective=kind)


def _check_network_and_sync(network, sync_every) -> None:
  """Raises unless ``network`` is a Network and ``sync_every`` an integer >= 1."""
  if not isinstance(network, costs.Network):
    raise TypeError(f"network must be a jaxcomp.perfmodel.Network, got {type(network).__name__}")
  if isinstance(sync_every, bool) or not isinstance(sync_every, int) or sync_every < 1:
    raise ValueError(f"sync_every must be an integer >= 1, got {sync_every!r}")


def _diloco(profile: ModelProfile, compressor, network: costs.Network, *,
            output: str, sync_every: int, **kw) -> Prediction:
  """:func:`predict` for ``sync_every > 1``: the step plus ``1 / H`` of a serial exchange."""
  if output != "mean":
    raise ValueError("sync_every > 1 (DiLoCo) runs with output='mean', "
                     "'islands' or 'islands_fsdp'")
  one = predict(profile, compressor, network, overlap="serial", **kw)
  extra = (one.step_time - profile.compute_time) / sync_every
  t = profile.compute_time + extra
  return dataclasses.replace(
      one, step_time=t, comm_time=one.comm_time / sync_every,
      exposed_comm=one.comm_time / sync_every,
      compute_time=profile.compute_time + one.codec_time / sync_every,
      codec_time=one.codec_time / sync_every,
      scaling_factor=profile.compute_time / t if t > 0 else 1.0,
      bytes_per_worker=one.bytes_per_worker / sync_every)


@dataclasses.dataclass(frozen=True)
class _Pricing:
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


def _pricing(compressor, network: costs.Network, kind: str, *, codec: CodecCost,
             output: str, error_feedback: bool | None,
             messages_per_bucket: int | None) -> _Pricing:
  """Checks ``output`` against the compressor and network and builds its :class:`_Pricing`."""
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
  return _Pricing(compressor, payload, library, network, output, group, nets,
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


def _resolved(pricing: _Pricing, n: int):
  """The collective that carries an ``n``-element bucket."""
  if isinstance(pricing.library, collectives.Auto):
    return pricing.library.pick(pricing.payload, n, wire.devices(pricing.group))
  return pricing.library


def _shard_of(pricing: _Pricing, n: int) -> int:
  """HSDP: elements of a device's shard of an ``n``-element bucket."""
  return collectives.chunk_size(n, pricing.nets["devices"].workers)


def _transfers(pricing: _Pricing, n: int) -> tuple:
  """The transfers of an ``n``-element bucket's exchange (cached per size)."""
  if n not in pricing.cache:
    pricing.cache[n] = _exchange_transfers(pricing, n)
  return pricing.cache[n]


def _exchange_transfers(pricing: _Pricing, n: int) -> tuple:
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


def _bucket_comm(pricing: _Pricing, n: int) -> float:
  """Seconds of an ``n``-element bucket's collectives."""
  return sum(costs.transfer_time(t, pricing.nets.get(t.axis_name, pricing.network))
             for t in _transfers(pricing, n))


def _bucket_codec(pricing: _Pricing, n: int) -> tuple[float, float]:
  """(encode before the exchange, decode work after it), seconds."""
  if pricing.output == "hsdp":
    # The shard's compressed mean across the nodes (the exact
    # reduce-scatter inside the node has no codec).
    return _mean_codec(pricing, _shard_of(pricing, n), pricing.nets["hosts"].workers,
                       [t for t in _transfers(pricing, n) if t.axis_name == "hosts"])
  p, codec = pricing.network.workers, pricing.codec
  if pricing.output == "shard":
    c = collectives.chunk_size(n, p)
    summed = all(t.kind == "reduce-scatter" for t in _transfers(pricing, n))
    # p chunk encodes; the owner decodes its chunk's p payloads (one sum
    # for a reduce-scatter), and error feedback the p own chunk payloads.
    dec = (1 if summed else p) + (p if pricing.error_feedback else 0)
    return p * codec.encode(c), dec * codec.decode(c)
  return _mean_codec(pricing, n, p, _transfers(pricing, n))


def _mean_codec(pricing: _Pricing, n: int, workers: int, ts) -> tuple[float, float]:
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


@dataclasses.dataclass
class _Timeline:
  """One step's clock and running totals, seconds (``sent``: bytes), as
  :func:`predict`'s steps advance them.

  Attributes:
    t: the compute stream's clock.
    comm: collectives' time so far.
    codec: encode and decode time so far.
    sent: payload bytes each worker has sent.
    net_free: when the network is next free.
    arrivals: per exchanged bucket still to decode: (collective done, its
      comm, its decode), seconds.
  """

  t: float = 0.0
  comm: float = 0.0
  codec: float = 0.0
  sent: float = 0.0
  net_free: float = 0.0
  arrivals: list[tuple[float, float, float]] = dataclasses.field(default_factory=list)


def _forward(pricing: _Pricing, profile: ModelProfile) -> _Timeline:
  """The parameters' all-gathers (FSDP, HSDP) and the forward pass."""
  line = _Timeline()
  # The forward pass waits for the parameters' all-gathers (float32): over
  # every worker (FSDP), or inside the node only (HSDP).
  hsdp = pricing.output == "hsdp"
  axis, gather_net = ("devices", pricing.nets["devices"]) if hsdp else ("data", pricing.network)
  if pricing.output in ("shard", "hsdp") and gather_net.workers > 1:
    w = gather_net.workers
    gathers = [a for n in profile.layer_sizes if n > 0 for a in wire.transfers(
        "all-gather", [4 * collectives.chunk_size(n, w)], axis, {axis: w})]
    line.t = line.comm = sum(costs.transfer_time(a, gather_net) for a in gathers)
  line.t += profile.forward_time
  line.net_free = line.t
  return line


def _backward(pricing: _Pricing, profile: ModelProfile, plan, mode: str,
              line: _Timeline) -> None:
  """The backward pass bucket by bucket: each bucket's encode, then its collective."""
  sizes = profile.layer_sizes
  for b in plan:
    n = sum(sizes[i] for i in b)
    line.t += sum(profile.backward_times[i] for i in b)
    if pricing.network.workers > 1 and n > 0:
      enc, dec = _bucket_codec(pricing, n)
      line.t += enc
      line.codec += enc
      c = _bucket_comm(pricing, n)
      line.sent += wire.operand_bytes(_transfers(pricing, n))
      line.comm += c
      start = max(line.t if mode == "wfbp" else -1.0, line.net_free)
      line.net_free = start + c
      line.arrivals.append((line.net_free, c, dec))


def _decode_arrivals(line: _Timeline, mode: str) -> None:
  """Each bucket's decode once its collective has arrived, as ``mode`` orders them."""
  arrivals = line.arrivals
  if mode == "serial":
    # One thing at a time: each collective, then its decode.
    for _, c, dec in arrivals:
      line.t += c + dec
      line.codec += dec
    arrivals = []
  elif mode == "after_backward":
    # No collective starts before the backward pass (and its encodes) ends.
    net_free, shifted = line.t, []
    for _, c, dec in arrivals:
      net_free += c
      shifted.append((net_free, c, dec))
    arrivals = shifted
  for arrive, _, dec in arrivals:
    line.t = max(line.t, arrive) + dec
    line.codec += dec


def _prediction(profile: ModelProfile, line: _Timeline, *, num_buckets: int,
                collective: str) -> Prediction:
  """The :class:`Prediction` of a finished step's timeline."""
  t = line.t
  busy = profile.compute_time + line.codec
  return Prediction(
      step_time=t,
      comm_time=line.comm,
      exposed_comm=max(0.0, t - busy),
      compute_time=busy,
      codec_time=line.codec,
      scaling_factor=profile.compute_time / t if t > 0 else 1.0,
      bytes_per_worker=line.sent,
      num_buckets=num_buckets,
      collective=collective)

def compare(profile: ModelProfile, compressors: Mapping[str, Any], network: costs.Network,
            *, codecs: Mapping[str, CodecCost] | None = None, buckets="layer",
            overlap: bool | str = True,
            collective: str | Mapping[str, str | None] | None = None,
            output: str = "mean", sync_every: int = 1) -> dict[str, Prediction]:
  """Predicts every compressor and the dense baseline; fills ``speedup``.

  ``collective``: None (each compressor's :func:`default_collective`), one
  of ``"allgather"``, ``"two_phase"``, ``"auto"`` for every compressor that
  is neither linear nor runs its own exchange (the others keep their
  default), or a mapping from names in ``compressors`` to a collective or
  None. The other arguments are :func:`predict`'s; ``sync_every`` applies to
  the compressors, not to the dense baseline (data parallelism), so that
  ``speedup`` says what DiLoCo gains over it; with ``output="islands"``
  the baseline is dense data parallelism over every worker
  (``output="mean"``), with ``"islands_fsdp"`` dense HSDP.

  The result maps ``"dense"`` and each name in ``compressors`` to a
  :class:`Prediction`; ``speedup`` is dense step time over that step time.

  Raises:
    ValueError: ``collective`` is not one of those, or names a compressor
      that is not in ``compressors``.
  """
  codecs = codecs or {}
  if isinstance(collective, Mapping):
    unknown = sorted(set(collective) - set(compressors))
    if unknown:
      raise ValueError(f"collective names {unknown}, which are not in compressors")
    chosen = dict(collective)
  else:
    if collective is not None:
      collective = _collective_name(collective)
    if collective not in (None, "allgather", "two_phase", "auto"):
      raise ValueError("collective must be None, 'allgather', 'two_phase', 'auto' or a "
                       f"mapping of compressor names, got {collective!r}")
    chosen = {name: None if c.linear or getattr(c, "own_exchange", False) else collective
              for name, c in compressors.items()}
  # The islands layouts are measured against data parallelism over every
  # worker (HSDP's sharding for FSDP islands), dense.
  baseline = {"islands": "mean", "islands_fsdp": "hsdp"}.get(output, output)
  dense = predict(profile, DenseCompressor(), network, buckets=buckets, overlap=overlap,
                  output=baseline)
  out = {"dense": dataclasses.replace(dense, speedup=1.0)}
  for name, c in compressors.items():
    pr = predict(profile, c, network, codec=codecs.get(name), buckets=buckets, overlap=overlap,
                 collective=chosen.get(name), output=output, sync_every=sync_every)
    out[name] = dataclasses.replace(pr, speedup=dense.step_time / pr.step_time)
  return out
