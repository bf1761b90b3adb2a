"""One step's timeline: the order of the backward pass's buckets and how
their collectives overlap the compute.

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

:func:`bucket_plan` says which tensors share a bucket, in the order the
backward pass finishes them; :func:`run_step` advances a :class:`Timeline`
through the step, with each bucket's cost from :mod:`jaxcomp.perfmodel.pricing`.
"""

from __future__ import annotations

import dataclasses
from typing import cast
from collections.abc import Callable, Sequence

from jaxcomp.perfmodel import costs
from jaxcomp.perfmodel.model_profile import ModelProfile
from jaxcomp.perfmodel.pricing import Pricing
from jaxcomp.perfmodel.pricing import bucket_codec
from jaxcomp.perfmodel.pricing import bucket_comm
from jaxcomp.perfmodel.pricing import transfers_of
from jaxcomp import bucketing
from jaxcomp import collectives
from jaxcomp import wire

# The public name; Timeline, overlap_mode and run_step serve the module prediction.
__all__ = ["bucket_plan"]


_OVERLAP_MODES = ("wfbp", "after_backward", "serial")


def overlap_mode(overlap) -> str:
  """:func:`jaxcomp.perfmodel.predict`'s ``overlap`` by its mode's name
  (``True``: ``"wfbp"``, ``False``: ``"after_backward"``)."""
  if overlap is True:
    return "wfbp"
  if overlap is False:
    return "after_backward"
  if overlap in _OVERLAP_MODES:
    return overlap
  raise ValueError(f"overlap must be True, False or one of {_OVERLAP_MODES}, got {overlap!r}")


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


@dataclasses.dataclass
class Timeline:
  """One step's clock and running totals, seconds (``sent``: bytes), as
  :func:`run_step`'s steps advance them.

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


def _forward(pricing: Pricing, profile: ModelProfile) -> Timeline:
  """The parameters' all-gathers (FSDP, HSDP) and the forward pass."""
  line = Timeline()
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


def _backward(pricing: Pricing, profile: ModelProfile, plan, mode: str,
              line: Timeline) -> None:
  """The backward pass bucket by bucket: each bucket's encode, then its collective."""
  sizes = profile.layer_sizes
  for b in plan:
    n = sum(sizes[i] for i in b)
    line.t += sum(profile.backward_times[i] for i in b)
    if pricing.network.workers > 1 and n > 0:
      enc, dec = bucket_codec(pricing, n)
      line.t += enc
      line.codec += enc
      c = bucket_comm(pricing, n)
      line.sent += wire.operand_bytes(transfers_of(pricing, n))
      line.comm += c
      start = max(line.t if mode == "wfbp" else -1.0, line.net_free)
      line.net_free = start + c
      line.arrivals.append((line.net_free, c, dec))


def _decode_arrivals(line: Timeline, mode: str) -> None:
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


def run_step(pricing: Pricing, profile: ModelProfile, plan, mode: str) -> Timeline:
  """One step's timeline: the parameters' all-gathers (FSDP, HSDP) and the
  forward pass, the backward pass with each bucket of ``plan`` encoded and
  sent, the decodes as ``mode`` orders them, then the optimizer update."""
  line = _forward(pricing, profile)
  _backward(pricing, profile, plan, mode, line)
  _decode_arrivals(line, mode)
  line.t += profile.update_time
  return line
