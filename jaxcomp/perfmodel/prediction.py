"""The end-to-end step-time prediction of compressed data-parallel training.

:func:`predict` combines a model's profile
(:mod:`jaxcomp.perfmodel.model_profile`), what each bucket's exchange costs
(:mod:`jaxcomp.perfmodel.pricing`) and the step's timeline of overlapping
compute and collectives (:mod:`jaxcomp.perfmodel.timeline`); DiLoCo's
``sync_every`` and the islands layouts are predicted from the predictions of
their parts. :func:`compare` predicts several compressors against the dense
baseline.

The outputs (:class:`Prediction`): step time, communication time (sum of the
collectives), exposed communication (step time minus compute-stream busy
time), scaling factor (throughput of ``p`` workers over ``p`` times one
worker's: ``T_1 / T_p`` with ``T_1`` = forward + backward + update) and
speedup over dense (uncompressed float32 all-reduce with the same buckets).
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Mapping

from jaxcomp.perfmodel import costs
from jaxcomp.perfmodel.model_profile import ModelProfile
from jaxcomp.perfmodel import optimizer_pricing
from jaxcomp.perfmodel.optimizer_pricing import CompressedOptimizer
from jaxcomp.perfmodel.pricing import CodecCost
from jaxcomp.perfmodel.pricing import DenseCompressor
from jaxcomp.perfmodel.pricing import bucket_comm
from jaxcomp.perfmodel.pricing import comm_kind
from jaxcomp.perfmodel.pricing import exchange_pricing
from jaxcomp.perfmodel.timeline import Timeline
from jaxcomp.perfmodel.timeline import bucket_plan
from jaxcomp.perfmodel.timeline import overlap_mode
from jaxcomp.perfmodel.timeline import run_step
from jaxcomp import collectives

__all__ = ["Prediction", "predict", "compare"]


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
      ``"islands"`` (DiLoCo across islands, ``layout=jaxcomp.Islands(over=...)``,
      on a hierarchical ``network`` of ``g =
      workers_per_node`` devices per island): every step an exact float32
      all-reduce of the gradient inside the island over ``intra`` (with
      ``buckets`` and ``overlap``), and every ``sync_every`` steps each of
      the ``g`` devices exchanges the whole pseudo-gradient with its
      counterparts in the other islands, compressed, the ``g`` devices of
      an island sharing its ``link``; ``"islands_fsdp"`` (FSDP inside each
      island, ``layout=jaxcomp.Islands(over=..., inside=jaxcomp.FSDP(...))``): the
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
  if isinstance(compressor, CompressedOptimizer):
    if output != "mean" or sync_every != 1 or collective is not None:
      raise ValueError(f"{compressor.name} runs its own exchange over replicated "
                       "parameters: output='mean', sync_every=1, collective=None")
    return _compressed_optimizer(profile, compressor, network, codec=codec,
                                 buckets=buckets, overlap=overlap)
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
  mode = overlap_mode(overlap)
  kind = comm_kind(compressor, collective)
  pricing = exchange_pricing(compressor, network, kind, codec=codec or CodecCost(),
                              output=output, error_feedback=error_feedback,
                              messages_per_bucket=messages_per_bucket)
  plan = bucket_plan(buckets, profile,
                     comm_time=lambda nbytes: bucket_comm(pricing, int(nbytes) // 4))
  line = run_step(pricing, profile, plan, mode)
  return _prediction(profile, line, num_buckets=len(plan), collective=kind)


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


def _compressed_optimizer(profile: ModelProfile, opt: CompressedOptimizer,
                          network: costs.Network, *, codec, buckets, overlap
                          ) -> Prediction:
  """:func:`predict` for DeepSpeed's compressed optimizers: the average of
  a run's dense steps (priced as the dense baseline), 1-bit steps (compute,
  then the 1-bit exchange of the momentum, serial) and skipped rounds
  (compute alone); see :mod:`jaxcomp.perfmodel.optimizer_pricing`."""
  if network.algorithm == "hierarchical" and network.workers_per_node > 1:
    raise ValueError(f"{opt.name}'s all-to-all is not modelled on a hierarchical "
                     "network: pass a ring network")
  dense = predict(profile, DenseCompressor(), network, buckets=buckets,
                  overlap=overlap)
  comm, work = optimizer_pricing.onebit_step(opt, profile.layer_sizes, network,
                                             codec)
  n_dense, n_onebit, n_skip = optimizer_pricing.optimizer_phases(opt)
  compute = profile.compute_time
  n = opt.steps
  t = (n_dense * dense.step_time + n_onebit * (compute + work + comm)
       + n_skip * compute) / n
  traffic = optimizer_pricing.optimizer_traffic(opt, profile.layer_sizes,
                                                network.workers)
  return Prediction(
      step_time=t,
      comm_time=(n_dense * dense.comm_time + n_onebit * comm) / n,
      exposed_comm=(n_dense * dense.exposed_comm + n_onebit * comm) / n,
      compute_time=compute + n_onebit * work / n,
      codec_time=n_onebit * work / n,
      scaling_factor=compute / t if t > 0 else 1.0,
      bytes_per_worker=traffic.total_bytes / n,
      num_buckets=dense.num_buckets, collective="own_exchange")


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


def _prediction(profile: ModelProfile, line: Timeline, *, num_buckets: int,
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
