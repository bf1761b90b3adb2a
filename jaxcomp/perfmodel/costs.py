"""Alpha-beta cost of the collectives jaxcomp uses.

A link is described by two numbers: ``alpha``, the start-up cost of one message
(seconds), and ``beta``, the time to move one byte (seconds per byte, the
inverse of the bandwidth). Costs follow the standard ring algorithms
(Thakur, Rabenseifner & Gropp, *Optimization of Collective Communication
Operations in MPICH*, 2005), which is also the model of Agarwal et al. 2022 and
Shi et al. (MG-WFBP) 2019:

* reduce-scatter of ``m`` bytes on ``p`` workers: ``(p-1)·alpha + (p-1)/p·m·beta``
* all-gather, ``m`` bytes contributed by each worker: ``(p-1)·alpha + (p-1)·m·beta``
* all-reduce of ``m`` bytes (reduce-scatter then all-gather):
  ``2(p-1)·alpha + 2(p-1)/p·m·beta``
* all-to-all, ``m`` bytes held by each worker, ``m/p`` to every peer:
  ``(p-1)·alpha + (p-1)/p·m·beta``

The counts are :mod:`jaxcomp.wire`'s table, read by :func:`ring_time`.
The hierarchical variants model ``p = nodes × workers_per_node`` with a fast
link inside a node and the slow link between nodes (exact all-reduce inside a
host, then across hosts, as in Horovod / NCCL's tree-of-rings).
"""

from __future__ import annotations

import dataclasses
import math

from jaxcomp import wire

__all__ = [
    "Link",
    "Network",
    "allreduce_time",
    "allgather_time",
    "reduce_scatter_time",
    "alltoall_time",
    "collective_time",
    "ring_time",
    "transfer_time",
    "COLLECTIVES",
]

# The collective kinds a network prices, spelled as jaxcomp.wire (and XLA's
# HLO) spell them.
COLLECTIVES = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all")

@dataclasses.dataclass(frozen=True)
class Link:
  """Alpha-beta description of one link.

  Attributes:
    alpha: start-up latency of one message, seconds (>= 0).
    beta: transfer time per byte, seconds/byte (> 0); ``8 / bits_per_second``.
  """

  alpha: float
  beta: float

  def __post_init__(self):
    if not (math.isfinite(self.alpha) and self.alpha >= 0):
      raise ValueError(f"alpha must be a finite number of seconds >= 0, got {self.alpha=}")
    if not (math.isfinite(self.beta) and self.beta > 0):
      raise ValueError(f"beta must be a finite number of seconds/byte > 0, got {self.beta=}")

  @classmethod
  def from_bandwidth(cls, gbps: float, latency_s: float = 0.0) -> Link:
    """A link of ``gbps`` Gbit/s (10^9 bit/s) and ``latency_s`` seconds per message."""
    if not (isinstance(gbps, (int, float)) and math.isfinite(gbps) and gbps > 0):
      raise ValueError(f"bandwidth must be > 0 Gbit/s, got {gbps!r}")
    if not (isinstance(latency_s, (int, float)) and math.isfinite(latency_s) and latency_s >= 0):
      raise ValueError(f"latency must be >= 0 seconds, got {latency_s!r}")
    return cls(alpha=float(latency_s), beta=8.0 / (gbps * 1e9))

  @property
  def gbps(self) -> float:
    """Bandwidth in Gbit/s."""
    return 8.0 / self.beta / 1e9


@dataclasses.dataclass(frozen=True)
class Network:
  """The workers and the links between them.

  Attributes:
    workers: number of data-parallel workers ``p`` (>= 1).
    link: the link between workers ("ring") or between nodes ("hierarchical").
    algorithm: ``"ring"`` (one flat ring over all workers) or
      ``"hierarchical"`` (exact collective inside a node over ``intra``, then
      across nodes over ``link``).
    workers_per_node: workers sharing a node (hierarchical only); must divide
      ``workers``.
    intra: the link inside a node (hierarchical only).
    per_collective: optional ``{kind: Link}`` overriding ``link`` for some
      collectives (ring only), e.g. alpha and beta fitted separately to
      measured all-reduces and all-gathers of a runtime whose algorithms
      differ from the ideal ring.
  """

  workers: int
  link: Link
  algorithm: str = "ring"
  workers_per_node: int = 1
  intra: Link | None = None
  per_collective: dict | None = None

  def __post_init__(self):
    if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
      raise ValueError(f"workers must be an integer >= 1, got {self.workers!r}")
    if self.algorithm not in ("ring", "hierarchical"):
      raise ValueError(f"algorithm must be 'ring' or 'hierarchical', got {self.algorithm!r}")
    if self.algorithm == "hierarchical":
      g = self.workers_per_node
      if not isinstance(g, int) or g < 1 or self.workers % g:
        raise ValueError(
            f"workers_per_node={g!r} must be an integer >= 1 dividing workers={self.workers}")
      if self.intra is None:
        raise ValueError("algorithm='hierarchical' needs the intra-node link: pass intra=Link(...)")

    for kind in self.per_collective or {}:
      if kind not in COLLECTIVES:
        raise ValueError(f"unknown collective {kind!r} in per_collective; expected {COLLECTIVES}")

  def with_workers(self, workers: int) -> Network:
    return dataclasses.replace(self, workers=workers)

  def with_link(self, link: Link) -> Network:
    return dataclasses.replace(self, link=link, per_collective=None)


def _check(nbytes: float, p: int) -> None:
  if nbytes < 0:
    raise ValueError(f"message size must be >= 0 bytes, got {nbytes=}")
  if isinstance(p, bool) or not isinstance(p, int) or p < 1:
    raise ValueError(f"workers must be an integer >= 1, got {p=}")


def ring_time(kind: str, nbytes: float, p: int, link: Link) -> float:
  """One ring collective of :data:`jaxcomp.wire.KINDS` over ``p`` workers,
  seconds: ``messages * alpha + bytes * beta`` with the messages and bytes
  of :mod:`jaxcomp.wire`'s table (the one the collectives' statistics and
  the HLO traffic count read).

  Raises:
    ValueError: an unknown ``kind``, ``nbytes < 0`` or ``p < 1``.
  """
  _check(nbytes, p)
  return (wire.ring_messages(kind, p) * link.alpha
          + wire.ring_bytes(kind, nbytes, p) * link.beta)


def reduce_scatter_time(nbytes: float, p: int, link: Link) -> float:
  """Ring reduce-scatter of an ``nbytes`` buffer over ``p`` workers, seconds."""
  return ring_time("reduce-scatter", nbytes, p, link)


def allgather_time(nbytes: float, p: int, link: Link) -> float:
  """Ring all-gather where each of ``p`` workers contributes ``nbytes``, seconds."""
  return ring_time("all-gather", nbytes, p, link)


def allreduce_time(nbytes: float, p: int, link: Link) -> float:
  """Ring all-reduce of an ``nbytes`` buffer over ``p`` workers, seconds."""
  return ring_time("all-reduce", nbytes, p, link)


def alltoall_time(nbytes: float, p: int, link: Link) -> float:
  """All-to-all where each worker holds ``nbytes`` and sends ``nbytes/p`` to each peer."""
  return ring_time("all-to-all", nbytes, p, link)


_FLAT = {
    "all-reduce": allreduce_time,
    "all-gather": allgather_time,
    "reduce-scatter": reduce_scatter_time,
    "all-to-all": alltoall_time,
}


def collective_time(kind: str, nbytes: float, network: Network) -> float:
  """Time of one collective on ``network``, seconds.

  Args:
    kind: one of ``COLLECTIVES``.
    nbytes: for ``allgather`` the bytes each worker contributes; otherwise the
      size of the buffer each worker holds.
    network: workers, links and algorithm.

  Raises:
    ValueError: unknown ``kind`` or negative ``nbytes``.
  """
  if kind not in _FLAT:
    raise ValueError(f"unknown collective {kind!r}; expected one of {COLLECTIVES}")
  p = network.workers
  if network.algorithm == "ring" or network.workers_per_node == 1:
    link = (network.per_collective or {}).get(kind, network.link)
    return _FLAT[kind](nbytes, p, link)
  g = network.workers_per_node
  n = p // g
  intra, inter = network.intra, network.link
  assert intra is not None  # Network checks it for "hierarchical"
  if kind == "all-reduce":
    # Reduce-scatter in the node, g concurrent all-reduces of m/g between
    # nodes (sharing the node's link: m bytes through it), all-gather in the node.
    return (reduce_scatter_time(nbytes, g, intra)
            + (allreduce_time(nbytes, n, inter) if n > 1 else 0.0)
            + allgather_time(nbytes / g, g, intra))
  if kind == "reduce-scatter":
    return (reduce_scatter_time(nbytes, g, intra)
            + (reduce_scatter_time(nbytes, n, inter) if n > 1 else 0.0))
  if kind == "all-gather":
    # Gather in the node, exchange the node's g·m bytes between nodes, then
    # share what each local worker received ((n-1)·m) inside the node.
    return (allgather_time(nbytes, g, intra)
            + (allgather_time(g * nbytes, n, inter) if n > 1 else 0.0)
            + allgather_time((n - 1) * nbytes, g, intra))
  # all-to-all: the (n-1)/n share of all g workers' buffers leaves the node.
  return (alltoall_time(nbytes, g, intra)
          + (alltoall_time(g * nbytes, n, inter) if n > 1 else 0.0))


def transfer_time(transfer: wire.Transfer, network: Network) -> float:
  """Time of one collective the library issues (a
  :class:`jaxcomp.wire.Transfer`, as ``Collective.transfers`` lists them) on
  ``network``, seconds.

  Raises:
    ValueError: the transfer's group is not ``network.workers`` devices, or
      a collective-permute on a hierarchical network (not modelled).
  """
  if transfer.group_size != network.workers:
    raise ValueError(
        f"the transfer runs over {transfer.group_size} devices but the "
        f"network has workers={network.workers}")
  kind = transfer.kind
  if kind not in _FLAT:
    if network.algorithm == "hierarchical" and network.workers_per_node > 1:
      raise ValueError(f"{transfer.kind} is not modelled on a hierarchical network")
    return ring_time(transfer.kind, transfer.operand_bytes, network.workers, network.link)
  return collective_time(kind, transfer.operand_bytes, network)
