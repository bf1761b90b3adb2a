"""Hierarchical exchange: exact over the fast axis, compressed over the slow.

On a mesh such as ``("hosts", "devices")`` the links inside a host (NVLink,
shared memory) are much faster than the links between hosts. Averaging
exactly inside each host first and compressing only the traffic between
hosts keeps the accuracy of the dense mean where bandwidth is cheap (as
Horovod's hierarchical all-reduce and NCCL's trees do for dense buffers).
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _mesh
from jaxcomp import _parts
from jaxcomp import wire
from jaxcomp._mesh import AxisName
from jaxcomp.collectives import base
from jaxcomp.collectives.base import Collective, chunk_size

FAST_MODES = ("psum", "reduce_scatter")


def _norm(axis, param: str) -> tuple[str, ...] | None:
  return None if axis is None else _mesh.check_axis_name(axis, param)


def _one(axes: tuple[str, ...]):
  return axes[0] if len(axes) == 1 else axes


@base.register
@dataclasses.dataclass(frozen=True)
class Hierarchical(Collective):
  """Exact mean over ``fast_axis``, compressed exchange over ``slow_axis``.

  ``compressed_mean`` then averages over both axes::

    jaxcomp.compressed_mean(
        "topk", axis_name=("hosts", "devices"), ratio=0.01,
        collective=jaxcomp.collectives.Hierarchical(
            fast_axis="devices", slow_axis="hosts", inner="allgather"))

  or, naming no axes (the last axis of ``axis_name`` is the fast one, the
  others the slow ones): ``collective="hierarchical"``.

  Two ways to handle the fast axis (``fast``):

  * ``"psum"`` (default): ``v_host = pmean(v, fast_axis)`` (float32, exact),
    then ``inner`` exchanges ``v_host`` over ``slow_axis``; every device of
    a host sends the same payload (their keys agree: see
    :meth:`device_key`). Slow-link bytes per device: the inner collective's
    on ``n`` elements.
  * ``"reduce_scatter"``: ``lax.psum_scatter`` over ``fast_axis`` leaves
    each of the ``F`` devices of a host one ``ceil(n / F)``-element shard of
    the host mean (zero-padded), ``inner`` exchanges that shard over
    ``slow_axis``, and an exact ``all_gather`` over ``fast_axis`` rebuilds
    the buffer. Slow-link bytes per device shrink ``F``-fold.

  Error feedback: with host mean ``v_host`` and its compressed value
  ``C(v_host)`` (what the inner collective reports as sent), ``local`` is
  ``v - v_host + C(v_host)`` in ``"psum"`` mode, so each device's residual
  ``v - local`` is the host's compression error ``v_host - C(v_host)``,
  the same on every device of the host (the next step's fast-axis mean
  brings it back exactly once). In ``"reduce_scatter"`` mode the device
  owning shard ``f`` keeps ``F * (shard - C(shard))`` at that shard's
  positions and zeros elsewhere. Either way ``sum_i local_i / p`` equals
  the mean the inner collective delivers, so error feedback stays
  mass-conserving; the inner collective's own state (e.g. a two-phase
  residual) is kept per device as well.

  Args:
    fast_axis: mesh axis (or axes) averaged exactly; None: the last axis
      of ``axis_name``.
    slow_axis: mesh axis (or axes) over which ``inner`` compresses; None:
      the other axes of ``axis_name``.
    inner: the collective over ``slow_axis``: a registered name, a
      Collective, or None for :func:`jaxcomp.collectives.default_for` the
      compressor.
    fast: ``"psum"`` or ``"reduce_scatter"``.

  Raises:
    ValueError: at construction, for an empty or shared axis, a bad
      ``fast``; in :func:`jaxcomp.compressed_mean`, for an ``inner`` that
      cannot carry the compressor, or ``fast_axis``/``slow_axis`` that are
      not exactly the axes of ``axis_name``.
    NameError: at trace time, for an axis that is not bound by
      ``shard_map``/``pmap``.

  References:
    Sergeev & Del Balso, Horovod: fast and easy distributed deep learning
    in TensorFlow <https://arxiv.org/abs/1802.05799>, 2018; Wang et al.,
    Zen: Empowering Distributed Training with Sparsity-driven Data
    Synchronization (hierarchical centralisation), OSDI 2025.
  """

  name: ClassVar[str] = "hierarchical"
  reduce_scatter: ClassVar[bool] = False
  fast_axis: AxisName | None = None
  slow_axis: AxisName | None = None
  inner: str | Collective | None = None
  fast: str = "psum"

  def __post_init__(self):
    fast = _norm(self.fast_axis, "fast_axis")
    slow = _norm(self.slow_axis, "slow_axis")
    if (fast is None) != (slow is None):
      raise ValueError(
          "name both fast_axis and slow_axis, or neither (then the last "
          f"axis of axis_name is the fast one); got {self.fast_axis=}, "
          f"{self.slow_axis=}")
    if fast is not None and slow is not None and set(fast) & set(slow):
      raise ValueError(
          f"fast_axis and slow_axis must be different mesh axes, got "
          f"{self.fast_axis=}, {self.slow_axis=}")
    if self.fast not in FAST_MODES:
      raise ValueError(f"fast must be one of {FAST_MODES}, got "
                       f"{self.fast=!r}")
    if self.inner is not None and not isinstance(self.inner, (str, Collective)):
      raise TypeError(f"inner must be a collective name, a Collective or "
                      f"None, got {self.inner!r}")
    if isinstance(self.inner, Hierarchical):
      raise ValueError("inner cannot itself be Hierarchical; name more "
                       "slow axes instead")

  def _inner(self, compressor) -> Collective:
    return base.get(self.inner, compressor)

  def check(self, compressor):
    self._inner(compressor)
    if self.fast == "reduce_scatter" and compressor.own_exchange:
      raise ValueError(
          f"Hierarchical(fast='reduce_scatter') exchanges flat shards of the "
          f"host mean, and {compressor.name!r} runs its own exchange on whole "
          "tensors; use fast='psum' with it")

  def axes(self, axis_name: AxisName) -> tuple[AxisName, AxisName]:
    """``(fast_axis, slow_axis)`` resolved against ``axis_name``.

    Raises:
      ValueError: an axis named here is not in ``axis_name``, or
        ``axis_name`` has axes named neither fast nor slow.
    """
    axes = _mesh.axes(axis_name)
    fast = _norm(self.fast_axis, "fast_axis")
    slow = _norm(self.slow_axis, "slow_axis")
    if fast is None or slow is None:  # both or neither (__post_init__)
      if len(axes) < 2:
        raise ValueError(
            f"collective='hierarchical' needs axis_name with a slow and a "
            f"fast axis, e.g. ('hosts', 'devices'); got {axis_name=}")
      fast, slow = axes[-1:], axes[:-1]
    for role, names in (("fast_axis", fast), ("slow_axis", slow)):
      for a in names:
        if a not in axes:
          raise ValueError(
              f"Hierarchical: {role} {a!r} is not one of the axes averaged "
              f"over, axis_name={axis_name!r}; pass axis_name="
              f"{tuple(slow) + tuple(fast)!r} to compressed_mean")
    extra = [a for a in axes if a not in fast and a not in slow]
    if extra:
      raise ValueError(
          f"Hierarchical: axis_name has axes {extra} that are neither "
          f"fast_axis {_one(fast)!r} nor slow_axis {_one(slow)!r}")
    return _one(fast), _one(slow)

  def bind_axes(self, axis_name):
    fast, slow = self.axes(axis_name)
    return dataclasses.replace(self, fast_axis=fast, slow_axis=slow)

  def _bound_axes(self, axis_name, where: str):
    fast, slow = self.axes(axis_name)
    for role, ax in (("fast_axis", fast), ("slow_axis", slow)):
      _mesh.check_bound(ax, f"Hierarchical.{where}", role)
    return fast, slow

  def device_key(self, compressor, key, axis_name):
    """In ``"psum"`` mode the key depends on the slow-axis index only, so
    that the devices of a host, which hold the same host mean, send the
    same payload."""
    fast, slow = self._bound_axes(axis_name, "device_key")
    if compressor.randomness != "independent":
      return key
    if self.fast == "psum":
      return jax.random.fold_in(key, lax.axis_index(slow))
    return jax.random.fold_in(key, lax.axis_index(axis_name))

  def unsent(self, compressor, state):
    # The inner collective's state, over the slow axis.
    return self._inner(compressor).unsent(compressor, state)

  def init_state(self, compressor, shapes, key, axis_name):
    fast, slow = self._bound_axes(axis_name, "init_state")
    inner = self._inner(compressor)
    if self.fast == "psum":
      return inner.init_state(compressor, shapes, key, slow)
    c = chunk_size(sum(_parts.sizes(shapes)), lax.axis_size(fast))
    return _mesh.to_varying(inner.init_buffer(compressor, c, slow), fast)

  def exchange(self, compressor, parts, shapes, *, key, step, axis_name,
               state=()):
    fast, slow = self._bound_axes(axis_name, "exchange")
    inner = self._inner(compressor)
    sizes = _parts.sizes(shapes)
    x = _parts.concat(parts)
    if self.fast == "psum":
      host = _parts.split(lax.pmean(x, fast), sizes)
      mean, sent, state = inner.exchange(compressor, host, shapes, key=key,
                                         step=step, axis_name=slow,
                                         state=state)
      f32 = lambda a: a.astype(jnp.float32)
      local = tuple(f32(v) - f32(h) + c for v, h, c in zip(parts, host, sent))
      return mean, local, state
    n = x.shape[0]
    f_size = lax.axis_size(fast)
    c = chunk_size(n, f_size)
    padded = jnp.pad(x, (0, f_size * c - n))
    shard = (lax.psum_scatter(padded, fast, scatter_dimension=0, tiled=True)
             .astype(jnp.float32) / f_size)
    mean_shard, sent, state = inner.exchange_buffer(compressor, shard, key,
                                                  slow, state)
    mean = lax.all_gather(mean_shard, fast, tiled=True, to="invarying")[:n]
    start = lax.axis_index(fast) * c
    err = lax.dynamic_update_slice(jnp.zeros((f_size * c,), jnp.float32),
                                   f_size * (shard - sent), (start,))
    return (_parts.split(mean, sizes),
            _parts.split(x.astype(jnp.float32) - err[:n], sizes), state)

  def transfers(self, compressor, shapes, sizes, dtype=jnp.float32):
    """Over ``fast_axis`` the all-reduce of the bucket in its dtype
    (``itemsize * n``), or the reduce-scatter (``itemsize * F ceil(n / F)``)
    and the float32 all-gather (``4 ceil(n / F)``); over ``slow_axis`` the
    inner collective's transfers (on ``n`` elements, or on the float32
    ``ceil(n / F)``-element shard)."""
    item = jnp.dtype(dtype).itemsize
    fast, slow = self.axes(tuple(sizes))
    fast_sizes = {a: sizes[a] for a in _mesh.axes(fast)}
    slow_sizes = {a: sizes[a] for a in _mesh.axes(slow)}
    inner = self._inner(compressor)
    n = sum(_parts.sizes(shapes))
    if self.fast == "psum":
      return (wire.transfers("all-reduce", (item * n,), fast, fast_sizes)
              + inner.transfers(compressor, shapes, slow_sizes, dtype))
    f_size = wire.group_size(fast, fast_sizes)
    c = chunk_size(n, f_size)
    return (wire.transfers("reduce-scatter", (item * f_size * c,), fast,
                           fast_sizes)
            + inner.buffer_transfers(compressor, c, slow_sizes)
            + wire.transfers("all-gather", (4 * c,), fast, fast_sizes))
