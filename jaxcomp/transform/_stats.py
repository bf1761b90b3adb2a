"""Traffic statistics of a compressed exchange, carried in the state."""

from __future__ import annotations

from typing import NamedTuple, cast

import jax
import jax.numpy as jnp

from jaxcomp import wire


class CompressionStats(NamedTuple):
  """Per-step statistics, carried in the state (read with :func:`get_stats`).

  Two measures of one step's traffic, per device, each with the dense
  all-reduce of the same gradient beside it:

  * operand bytes (``bytes_sent``, ``dense_bytes``): what this device hands
    to collectives (the compressor payloads plus the exact leaves), what
    compression shrinks and what :func:`jaxcomp.collective_traffic` reads
    as ``operand_bytes``;
  * wire bytes (``wire_bytes``, ``dense_wire_bytes``): what this device
    sends over the links by the ring algorithms for its collectives and
    device count (:mod:`jaxcomp.wire`; ``Traffic.ring_bytes``). All-gather
    based exchanges grow with the device count here, so this is the basis
    on which to compare with a dense all-reduce: on 8 devices top-k at 1%
    is 50x fewer operand bytes but 12.5x fewer wire bytes.

  A compression factor is dense over compressed (higher is fewer bytes).
  The non-finite flag (one scalar all-reduce) is not counted.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1)
    >>> state, _ = jaxcomp.init_sharded(tx, {"w": jnp.zeros((8, 4))},
    ...                                 mesh, "data")
    >>> stats = jaxcomp.get_stats(state)  # a CompressionStats
    >>> float(stats.compression_factor), float(stats.wire_compression_factor)
    (4.0, 1.0)
  """

  bytes_sent: jax.Array  # shape=(), float32, operand bytes per device per step
  dense_bytes: jax.Array  # shape=(), float32, of a dense all-reduce
  compression_factor: jax.Array  # shape=(), float32, dense_bytes / bytes_sent
  wire_bytes: jax.Array  # shape=(), float32, ring bytes per device per step
  dense_wire_bytes: jax.Array  # shape=(), float32, of a dense all-reduce
  wire_compression_factor: jax.Array  # shape=(), float32, dense_wire / wire
  residual_norm: jax.Array  # shape=(), float32, this device's L2 residual
  skipped_steps: jax.Array  # shape=(), int32, steps skipped for non-finite
  state_bytes: jax.Array  # shape=(), float32, bytes of per-device state
  #                         (error feedback, the collective's) on each device


def traffic_figures(transfers, p: int, *, exact_bytes: int, dense_bytes: int,
                    dense_kind: str, state_bytes: int) -> dict[str, float]:
  """The static fields of :class:`CompressionStats` as Python floats, for an
  exchange issuing ``transfers`` plus ``exact_bytes`` sent densely by a
  ``dense_kind`` collective over ``p`` devices, against ``dense_bytes`` sent
  that way; ``state_bytes`` of per-device state. Plain numbers, so that a
  transform computes them once per layout and reuses them in any trace."""
  sent = wire.operand_bytes(transfers) + exact_bytes
  on_wire = (wire.total_ring_bytes(transfers)
             + wire.ring_bytes(dense_kind, exact_bytes, p))
  dense_wire = wire.ring_bytes(dense_kind, dense_bytes, p)
  return dict(bytes_sent=float(sent), dense_bytes=float(dense_bytes),
              compression_factor=float(dense_bytes / max(sent, 1)),
              wire_bytes=float(on_wire), dense_wire_bytes=float(dense_wire),
              wire_compression_factor=float(
                  dense_wire / on_wire if on_wire else 1.0),
              state_bytes=float(state_bytes))


def as_arrays(figures: dict[str, float]) -> dict[str, jax.Array]:
  """:func:`traffic_figures` as the float32 scalars the state holds."""
  return {k: jnp.asarray(v, jnp.float32) for k, v in figures.items()}


def traffic_stats(transfers, p: int, *, exact_bytes: int, dense_bytes: int,
                  dense_kind: str, state_bytes: int) -> dict:
  """The static fields of :class:`CompressionStats` (float32 scalars) for an
  exchange issuing ``transfers`` plus ``exact_bytes`` sent densely by a
  ``dense_kind`` collective over ``p`` devices, against ``dense_bytes`` sent
  that way; ``state_bytes`` of per-device state."""
  return as_arrays(traffic_figures(
      transfers, p, exact_bytes=exact_bytes, dense_bytes=dense_bytes,
      dense_kind=dense_kind, state_bytes=state_bytes))


def _has_stats(x) -> bool:
  """Whether ``x`` is a transform state carrying :class:`CompressionStats`
  in a ``stats`` field (``compressed_mean``'s, ``jaxcomp.demo``'s)."""
  return isinstance(x, tuple) and isinstance(getattr(x, "stats", None),
                                             CompressionStats)


def get_stats(state, *, by_path: bool = False):
  """The statistics of the :func:`compressed_mean` transforms (and
  :func:`jaxcomp.demo`) in an optimizer state (e.g. the state of an
  ``optax.chain``, a ``multi_transform`` or a :func:`jaxcomp.multi_steps`).

  Args:
    state: an optimizer state (global or per-device view).
    by_path: return each transform's :class:`CompressionStats` by its path
      in ``state`` instead of one total.

  Returns:
    With ``by_path=False``: one :class:`CompressionStats` totalling every
    transform found (bytes and skipped steps add up, the compression factors
    are the totals' quotients, the residual norms combine as the norm of
    the concatenated residuals, per device where every transform's norm has
    the same placement, else as one norm of all of them: HSDP's transforms
    over devices and over hosts do not line up device by device), or None
    if there is none. With ``by_path=True``: ``{path string:
    CompressionStats}``, in tree order.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.1),
    ...                  optax.sgd(0.1))
    >>> state, _ = jaxcomp.init_sharded(tx, {"w": jnp.zeros((8, 4))},
    ...                                 mesh, "data")
    >>> float(jaxcomp.get_stats(state).bytes_sent)  # 4 values + 4 indices
    32.0
    >>> list(jaxcomp.get_stats(state, by_path=True))  # by the chain's index
    ['[0]']
  """
  found = []

  def visit(path, x):
    if _has_stats(x):
      found.append((jax.tree_util.keystr(path), x.stats))

  jax.tree_util.tree_map_with_path(visit, state, is_leaf=_has_stats)
  if by_path:
    return dict(found)
  if not found:
    return None
  if len(found) == 1:
    return found[0][1]
  total = lambda f: cast(jax.Array, sum(getattr(s, f) for _, s in found))
  norms = [s.residual_norm for _, s in found]
  if len({jnp.shape(r) for r in norms}) == 1:
    residual = jnp.sqrt(sum(r ** 2 for r in norms))
  else:
    residual = jnp.sqrt(sum(jnp.sum(r ** 2) for r in norms))
  sent, dense = total("bytes_sent"), total("dense_bytes")
  on_wire, dense_wire = total("wire_bytes"), total("dense_wire_bytes")
  return CompressionStats(
      bytes_sent=sent, dense_bytes=dense,
      compression_factor=dense / jnp.maximum(sent, 1.0),
      wire_bytes=on_wire, dense_wire_bytes=dense_wire,
      wire_compression_factor=jnp.where(
          on_wire > 0, dense_wire / jnp.maximum(on_wire, 1.0), 1.0),
      residual_norm=residual,
      skipped_steps=total("skipped_steps"), state_bytes=total("state_bytes"))
