"""DeepSpeed's 1-bit compressed all-reduce with worker and server error
compensation, and the per-phase byte counts of the optimizers built on it.

One exchange of a list of flat float32 buffers ``x_i`` (``n_i`` elements
each) over ``p`` devices, as DeepSpeed's ``NcclBackend.compressed_allreduce``
runs it for each tensor:

1. Pad ``x_i`` with zeros to ``N_i``, ``n_i`` rounded up to a multiple of
   ``p * lcm(p, 8)`` (DeepSpeed's ``corrected_tensor_size``), and add this
   device's worker error ``e_i`` (float32 ``(N_i,)``): ``b = x_i + e_i``.
2. Compress ``b`` to ``s * sign(b)`` with ``sign(0) = +1`` and the scale
   ``s = ||b||_2 / sqrt(N_i)``; the new worker error is ``b - s *
   sign(b)``.
3. Chunk ``j`` (``c_i = N_i / p`` elements) of the signs goes to device
   ``j`` (one all-to-all of the packed signs of every buffer), every scale
   to every device (an all-gather of ``L`` float32 scalars).
4. Device ``j`` averages its chunk over the devices, ``sum_k s_k
   sign_k / p``, adds its server error ``r_i`` (float32 ``(c_i,)``) and
   compresses the sum the same way (its scale over the ``c_i`` elements);
   the new server error is what that loses.
5. The server chunks' signs and scales are all-gathered; every device
   decodes the same average, cut back to ``n_i`` elements.

The padded tail takes part as in DeepSpeed: it carries worker error (its
zeros have sign +1) and counts in the scales' ``sqrt(N_i)``.

References:
  Tang et al., 1-bit Adam: Communication Efficient Large-Scale Training
  with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>, ICML
  2021 (Algorithm 1: worker and server error compensation); DeepSpeed,
  ``deepspeed/runtime/comm/nccl.py`` (``compressed_allreduce``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
import optax

from jaxcomp import _mesh
from jaxcomp import wire
from jaxcomp._mesh import AxisName
from jaxcomp.kernels import bitpack
from jaxcomp.transform import OneBitStats


def padded_size(n: int, p: int) -> int:
  """DeepSpeed's ``corrected_tensor_size``: ``n`` rounded up to a multiple
  of ``p * lcm(p, 8)`` (0 stays 0)."""
  unit = p * math.lcm(p, 8)
  return -(-n // unit) * unit


def init_errors(sizes: list[int], axis_name: AxisName
                ) -> tuple[tuple[jax.Array, ...], tuple[jax.Array, ...]]:
  """``(worker_error, server_error)`` for buffers of ``sizes`` elements:
  per buffer float32 zeros ``(N_i,)`` and ``(N_i / p,)``, varying over
  ``axis_name`` (inside ``shard_map``)."""
  p = _mesh.axis_size(axis_name)
  padded = [padded_size(n, p) for n in sizes]
  return (tuple(_mesh.varying_zeros(m, axis_name) for m in padded),
          tuple(_mesh.varying_zeros(m // p, axis_name) for m in padded))


def _scaled_sign(b: jax.Array) -> tuple[jax.Array, jax.Array]:
  """``(scale, signs)``: float32 ``||b||_2 / sqrt(len(b))`` and ``+1 / -1``
  (``sign(0) = +1``, DeepSpeed's ``sign().add_(1).bool()``)."""
  scale = jnp.sqrt(jnp.sum(b * b)) / jnp.float32(math.sqrt(b.shape[-1]))
  return scale, jnp.where(b >= 0, jnp.float32(1), jnp.float32(-1))


def _pack(rows: jax.Array) -> jax.Array:
  """uint32 ``(r, ceil(c / 32))`` packed signs of ``+1 / -1`` rows
  ``(r, c)`` (bit 1 for -1)."""
  return jax.vmap(lambda s: bitpack.pack_bits_reference(
      (s < 0).astype(jnp.uint32), 1))(rows)


def _unpack(words: jax.Array, c: int) -> jax.Array:
  """float32 ``(r, c)`` of ``+1 / -1`` from packed rows ``(r, w)``."""
  return jax.vmap(lambda w: jnp.float32(1) - jnp.float32(2) * (
      bitpack.unpack_bits_reference(w, 1, c).astype(jnp.float32)))(words)


def compressed_allreduce(xs: list[jax.Array], worker_error, server_error,
                         axis_name: AxisName):
  """The 1-bit average of per-device flat buffers (see the module).

  Runs inside ``jax.shard_map`` over ``axis_name``: four collectives for
  all the buffers together (an all-to-all of packed signs, three
  all-gathers).

  Args:
    xs: per buffer float32 ``(n_i,)``, this device's (varying).
    worker_error: per buffer float32 ``(N_i,)`` (:func:`init_errors`).
    server_error: per buffer float32 ``(N_i / p,)``.
    axis_name: the mesh axis (or axes) to average over.

  Returns:
    ``(means, worker_error, server_error)``: per buffer float32 ``(n_i,)``,
    identical on every device (typed invariant), and the new errors.
  """
  p = _mesh.axis_size(axis_name)
  live = [i for i, x in enumerate(xs) if x.shape[0]]
  if not live:
    return list(xs), tuple(worker_error), tuple(server_error)
  worker, server, out = list(worker_error), list(server_error), list(xs)
  sent, scales = [], []
  for i in live:
    b = jnp.pad(xs[i], (0, worker[i].shape[0] - xs[i].shape[0])) + worker[i]
    scale, signs = _scaled_sign(b)
    worker[i] = b - scale * signs
    sent.append(_pack(signs.reshape(p, -1)))
    scales.append(scale)
  widths = [w.shape[1] for w in sent]
  starts = [sum(widths[:k]) for k in range(len(widths))]
  # received[k]: device k's signs of this device's chunk, of every buffer.
  received = lax.all_to_all(jnp.concatenate(sent, axis=1), axis_name, 0, 0)
  worker_scales = lax.all_gather(jnp.stack(scales), axis_name)  # (p, L)
  mine, server_scales = [], []
  for k, i in enumerate(live):
    c = server[i].shape[0]
    signs = _unpack(received[:, starts[k]:starts[k] + widths[k]], c)
    avg = jnp.sum(signs * (worker_scales[:, k] * jnp.float32(1 / p))[:, None],
                  axis=0) + server[i]
    scale, s = _scaled_sign(avg)
    server[i] = avg - scale * s
    mine.append(_pack(s[None])[0])
    server_scales.append(scale)
  words = lax.all_gather(jnp.concatenate(mine), axis_name, to="invarying")
  all_scales = lax.all_gather(jnp.stack(server_scales), axis_name,
                              to="invarying")
  for k, i in enumerate(live):
    c = server[i].shape[0]
    signs = _unpack(words[:, starts[k]:starts[k] + widths[k]], c)
    out[i] = (signs * all_scales[:, k][:, None]).reshape(-1)[:xs[i].shape[0]]
  return out, tuple(worker), tuple(server)


def compressed_transfers(sizes: list[int], axis_sizes: dict[str, int]
                         ) -> tuple[wire.Transfer, ...]:
  """The collectives of one :func:`compressed_allreduce` of buffers of
  ``sizes`` elements, per device: the all-to-all of ``p`` chunks' packed
  signs (``4 p W`` bytes, ``W`` words per chunk over every buffer), the
  all-gathers of the worker scales (``4 L``), of this device's server
  chunk signs (``4 W``) and of the server scales (``4 L``)."""
  p, axis = wire.devices(axis_sizes), wire.axes_of(axis_sizes)
  live = [n for n in sizes if n]
  if not live:
    return ()
  w = sum(bitpack.packed_words(padded_size(n, p) // p, 1) for n in live)
  scales = 4 * len(live)
  return (wire.transfers("all-to-all", [4 * p * w], axis, axis_sizes)
          + wire.transfers("all-gather", [scales, 4 * w, scales], axis,
                           axis_sizes))


def dense_transfers(nbytes: list[int], axis_sizes: dict[str, int]
                    ) -> tuple[wire.Transfer, ...]:
  """A dense all-reduce of each leaf of ``nbytes`` bytes (XLA runs one per
  array)."""
  return wire.transfers("all-reduce", [b for b in nbytes if b],
                        wire.axes_of(axis_sizes), axis_sizes)


def phase_transfers(sizes: list[int], axis_sizes: dict[str, int], *,
                    itemsize: int = 4, fused: bool = False
                    ) -> dict[str, tuple[wire.Transfer, ...]]:
  """The collectives of each phase's exchange, per device, for leaves of
  ``sizes`` elements over a mesh of ``axis_sizes``: what a cost model
  prices (``jaxcomp.perfmodel.costs.transfer_time`` each) and what the
  optimizers' statistics count.

  Args:
    sizes: elements per leaf.
    axis_sizes: ``{axis: devices}`` of the exchange's axes.
    itemsize: bytes per gradient element of the dense exchange.
    fused: the 1-bit exchange of all leaves as one buffer (1-bit LAMB's),
      else one per leaf (1-bit Adam's, 0/1 Adam's).

  Returns:
    ``{"dense": ..., "compressed": ...}``: the dense all-reduce of every
    leaf (warm-up, 0/1 Adam's variance steps) and one 1-bit exchange (see
    :func:`compressed_allreduce`).

  Example:
    >>> from jaxcomp import optimizers, wire
    >>> t = optimizers.phase_transfers([4096], {"data": 8})
    >>> [(x.kind, x.operand_bytes) for x in t["compressed"]]
    [('all-to-all', 512), ('all-gather', 4), ('all-gather', 64), ('all-gather', 4)]
    >>> dense, onebit = (wire.total_ring_bytes(t[k]) for k in t)
    >>> dense, onebit  # ring bytes: 30x fewer
    (28672.0, 952.0)
  """
  return {"dense": dense_transfers([n * itemsize for n in sizes], axis_sizes),
          "compressed": compressed_transfers(
              [sum(sizes)] if fused else list(sizes), axis_sizes)}


def init_stats(nbytes: list[int], sizes: list[int], axis_name: AxisName,
               held) -> OneBitStats:
  """Zero counters and the byte figures of leaves of ``nbytes`` bytes and
  ``sizes`` elements (inside ``shard_map``); ``held``: the per-device
  state."""
  axis_sizes = _mesh.axis_sizes(axis_name)
  p = wire.devices(axis_sizes)
  dense, comp = (dense_transfers(nbytes, axis_sizes),
                 compressed_transfers(sizes, axis_sizes))
  f32 = lambda v: jnp.asarray(v, jnp.float32)
  return OneBitStats(
      dense_bytes=f32(wire.operand_bytes(dense)),
      dense_wire_bytes=f32(wire.total_ring_bytes(dense) if p > 1 else 0.0),
      compressed_bytes=f32(wire.operand_bytes(comp)),
      compressed_wire_bytes=f32(wire.total_ring_bytes(comp)),
      dense_steps=jnp.zeros((), jnp.int32),
      compressed_steps=jnp.zeros((), jnp.int32),
      state_bytes=f32(sum(x.size * x.dtype.itemsize
                          for x in jax.tree.leaves(held))),
      skipped_steps=jnp.zeros((), jnp.int32))


def count(stats: OneBitStats, dense, compressed) -> OneBitStats:
  """``stats`` with one step counted: ``dense`` / ``compressed`` (bool
  scalars) say which exchange it made."""
  return stats._replace(
      dense_steps=stats.dense_steps + jnp.asarray(dense, jnp.int32),
      compressed_steps=stats.compressed_steps + jnp.asarray(compressed,
                                                            jnp.int32))


NONFINITE = ("skip", "none")


def check_nonfinite(nonfinite) -> str:
  """``nonfinite`` if it is one of :data:`NONFINITE`, else ValueError."""
  if nonfinite not in NONFINITE:
    raise ValueError(f"nonfinite must be one of {NONFINITE}, got "
                     f"{nonfinite=!r}")
  return nonfinite


def guard_nonfinite(update: Callable, axis_name: AxisName, nonfinite: str,
                    who: str) -> Callable:
  """``update`` (an optax update function) with the non-finite policy
  ``nonfinite``: ``"skip"``, a step where any device's gradient holds a
  NaN or Inf returns zero updates and leaves the whole state as it was
  but for one more ``state.stats.skipped_steps`` (:class:`OneBitStats`;
  nothing else is exchanged on it; the step counter does not move, so
  the schedule resumes where it stopped), at the cost of one 4-byte
  all-reduce every step; ``"none"``, no check (a NaN reaches the
  momentum and, through the 1-bit exchange, every device). ``update``'s
  state is the optimizer's own (a named tuple with a ``stats`` field)."""
  if nonfinite == "none":
    return update

  def guarded(updates, state, params=None):
    _mesh.check_bound(axis_name, f"{who}.update")
    bad = _mesh.any_nonfinite(jax.tree.leaves(updates), axis_name)

    def skip(_):
      zeros = jax.tree.map(
          lambda x: jnp.zeros(jnp.shape(x), jnp.result_type(x)), updates)
      stats = state.stats
      return zeros, state._replace(stats=stats._replace(
          skipped_steps=stats.skipped_steps + jnp.int32(1)))

    return _mesh.cond(bad, skip, lambda _: update(updates, state, params),
                      None)

  return guarded


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class OptimizerConfig:
  """A compressed optimizer's hyperparameters, as static pytree data of its
  state (read by :func:`jaxcomp.optimizers.optimizer_configs`, saved by
  :class:`jaxcomp.checkpoint.Checkpointer` beside ``compressed_mean``'s).

  Like :class:`jaxcomp.transform.TransformConfig`, any two compare equal,
  so that the configuration takes no part in the identity of the state's
  tree structure. ``text``: JSON with sorted keys; a learning-rate
  schedule reads ``"scheduled"``.
  """

  text: str = "{}"

  @classmethod
  def of(cls, name: str, spec, **extra) -> OptimizerConfig:
    """From an optimizer's name, its spec dataclass (nested specs
    flattened) and ``extra`` fields."""
    fields: dict[str, Any] = {"optimizer": name}

    def add(obj):
      for f in dataclasses.fields(obj):
        v = getattr(obj, f.name)
        if dataclasses.is_dataclass(v):
          add(v)
        else:
          fields[f.name] = ("scheduled" if callable(v) else
                            list(v) if isinstance(v, tuple) else v)

    add(spec)
    fields.update(extra)
    return cls(json.dumps(fields, sort_keys=True))

  def __eq__(self, other) -> bool:
    return isinstance(other, OptimizerConfig)

  def __hash__(self) -> int:
    return hash(OptimizerConfig)

  def as_dict(self) -> dict[str, Any]:
    """The configuration as a dict."""
    return json.loads(self.text)


def with_config(init: Callable, config: OptimizerConfig) -> Callable:
  """``init`` whose state carries ``config`` (its ``config`` field)."""
  return lambda params: init(params)._replace(config=config)


def transformation(name: str, spec, init: Callable, update: Callable,
                   axis_name: AxisName, nonfinite: str
                   ) -> optax.GradientTransformation:
  """The optimizer ``name`` as an Optax transformation: ``init(spec,
  params)`` with its config attached (:func:`with_config`) and
  ``update(spec, updates, state, params)`` behind the non-finite guard
  (:func:`guard_nonfinite`).

  Raises:
    ValueError: ``nonfinite`` is not one of :data:`NONFINITE`.
  """
  config = OptimizerConfig.of(name, spec, nonfinite=nonfinite)
  return optax.GradientTransformation(
      with_config(functools.partial(init, spec), config),
      guard_nonfinite(functools.partial(update, spec), axis_name,
                      check_nonfinite(nonfinite), name))  # pyright: ignore[reportArgumentType]
