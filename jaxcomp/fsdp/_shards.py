"""Flat shards of sharded data parallelism (FSDP / ZeRO-3): the layout
(:func:`shard_params`, :func:`unshard_params`), the forward all-gather
(:func:`gather_params`) and the per-device gradient of the gathered
parameters (:func:`value_and_grad`). :mod:`jaxcomp.fsdp` documents them and
places and steps them through :mod:`jaxcomp.steps`."""

from __future__ import annotations

import math
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcomp import _mesh
from jaxcomp import compressors
from jaxcomp import distributed
from jaxcomp import optimizers
from jaxcomp import placement
from jaxcomp import transform
from jaxcomp import wire
from jaxcomp._mesh import to_varying
from jaxcomp._mesh import AxisName
from jaxcomp.collectives.base import chunk_size
from jaxcomp.lowcomm import holds_diloco


def shard_params(params, mesh, axis_name: AxisName = "data"):
  """Flat shards of ``params`` placed on ``mesh``.

  Args:
    params: a pytree of arrays (the whole parameters).
    mesh: the device mesh.
    axis_name: the data axis (or tuple of axes) to shard over.

  Returns:
    ``(shards, shapes)``: ``shards`` has one float array of ``p * c``
    elements per leaf (``c = ceil(n / p)``, :func:`jaxcomp.collectives.chunk_size`),
    zero-padded and placed
    with ``NamedSharding(mesh, P(axis_name))``; ``shapes`` holds each leaf's
    ``jax.ShapeDtypeStruct`` (for :func:`gather_params`,
    :func:`unshard_params`).

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``.
  """
  placement.check_mesh_axes(mesh, axis_name)
  p = wire.group_size(axis_name, dict(mesh.shape))
  # global_array, not device_put: it works on multi-process meshes too.
  shards = distributed.global_array(
      jax.tree.map(lambda x: _flat_padded(x, p), params), mesh, P(axis_name))
  return shards, shapes_of(params)


def shapes_of(params):
  """Each leaf's ``jax.ShapeDtypeStruct`` (what :func:`gather_params` and
  :func:`unshard_params` rebuild the whole parameters in)."""
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                     jnp.result_type(x)),
                      params)


def _flat_padded(x, p: int):
  """``x`` raveled and zero-padded to ``p * chunk_size(n, p)`` elements:
  the ``p`` flat shards of one leaf, in order."""
  x = jnp.ravel(x)
  return jnp.pad(x, (0, p * chunk_size(x.size, p) - x.size))


def shard_copies(params, mesh, copies_over: AxisName,
                 shard_axis: AxisName):
  """FSDP inside islands: one copy of ``params`` per island of
  ``copies_over``, each held as flat shards over ``shard_axis``: every leaf
  ``(islands, p * c)`` (zero-padded as :func:`shard_params`), placed with
  ``P(copies_over, shard_axis)``."""
  p = wire.group_size(shard_axis, dict(mesh.shape))
  n = wire.group_size(copies_over, dict(mesh.shape))

  def copies(x):
    x = _flat_padded(x, p)
    return jnp.broadcast_to(x[None], (n, x.size))

  return distributed.global_array(jax.tree.map(copies, params), mesh,
                                  P(copies_over, shard_axis))


def unshard_params(shards, shapes):
  """The whole parameters from global flat shards (outside ``shard_map``):
  each leaf's first ``n`` elements in its shape, replicated on the shards'
  mesh."""
  def one(x, s):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      x = jax.device_put(x, NamedSharding(x.sharding.mesh, P()))
    # A DiLoCo anchor of FSDP islands is per device, (p, c): the same
    # elements in the same order.
    return x.reshape(-1)[:math.prod(s.shape)].reshape(s.shape)
  return jax.tree.map(one, shards, shapes)


def check_param_compressor(compressor):
  """The compressor for the parameters' forward all-gather (ZeRO++'s qwZ),
  from a name or instance; None for none.

  Raises:
    ValueError: a compressor with randomness or an exchange of its own
      (every device must rebuild the same parameters from the same
      payloads, and no key is shared for it).
  """
  if compressor is None:
    return None
  comp = compressors.get(compressor)
  if comp.own_exchange or comp.randomness != "none":
    raise ValueError(
        f"param_compressor={comp.name!r} cannot compress the parameters' "
        "all-gather: it needs a deterministic compressor with no exchange of "
        "its own (e.g. 'int8_block', 'fp8_block', 'bf16')")
  return comp


def gather_params(shards, shapes, axis_name: AxisName = "data", *,
                  compressor=None):
  """Inside ``shard_map``: all-gathers this device's flat shards into the
  whole parameters (one ``lax.all_gather`` per leaf, in its dtype).

  ``compressor`` (a name or instance, deterministic; ZeRO++'s qwZ, Wang et
  al. 2023):
  each device encodes its own shard, the payloads are all-gathered and
  every device decodes all of them, so the forward pass (and the gradient)
  sees the parameters as that compressor rebuilds them, identically on
  every device, while the optimizer keeps updating the exact shards.
  """
  comp = check_param_compressor(compressor)

  def one(x, s):
    n = math.prod(s.shape)
    if n == 0:  # XLA refuses an all-gather of a zero-size dimension
      return to_varying(jnp.zeros(s.shape, x.dtype), axis_name)
    if comp is None:
      return lax.all_gather(x, axis_name, tiled=True)[:n].reshape(s.shape)
    key = jax.random.key(0)  # unused: the compressor has no randomness
    payload = comp.encode(x.astype(jnp.float32), key)
    gathered = jax.tree.map(lambda a: lax.all_gather(a, axis_name), payload)
    decode = comp.decode
    whole = jax.vmap(lambda pl: decode(pl, x.shape[0], key))(gathered)
    return whole.reshape(-1)[:n].reshape(s.shape).astype(x.dtype)

  return jax.tree.map(one, shards, shapes)


def value_and_grad(loss_fn: Callable, shapes, axis_name: AxisName = "data", *,
                   shard_axis: AxisName | None = None,
                   param_compressor=None, has_aux: bool = False) -> Callable:
  """Inside ``shard_map``: ``f(shards, *args) -> (value, grads)``, the loss of
  the gathered parameters and this device's gradient with respect to them
  (whole-shaped, varying over ``axis_name``): what
  ``compressed_mean(..., output="shard")`` takes.

  Args:
    loss_fn: ``loss_fn(params, *args) -> loss`` on the whole parameters
      (or ``(loss, aux)`` with ``has_aux``).
    shapes: the leaves' shapes, from :func:`shard_params`.
    axis_name: the data axes (the batch is split over them; the gradient
      varies over them).
    shard_axis: the axis the parameters are sharded over (default
      ``axis_name``; HSDP: the fast axis inside a host).
    param_compressor: compress the parameters' all-gather (qwZ; see
      :func:`gather_params`), e.g. ``"int8_block"``.
    has_aux: as in ``jax.value_and_grad``.
  """
  param_comp = check_param_compressor(param_compressor)
  vg = placement.per_device_value_and_grad(loss_fn, axis_name, has_aux=has_aux)
  shard_axis = axis_name if shard_axis is None else shard_axis

  def wrapped(shards, *args, **kwargs):
    return vg(gather_params(shards, shapes, shard_axis,
                            compressor=param_comp), *args, **kwargs)

  return wrapped


def check_transform(tx, shards, mesh, shard_axis, copies_over=None) -> None:
  """Raises ValueError unless ``tx`` reduce-scatters over ``shard_axis`` what
  an FSDP layout needs (see :func:`check_shard_outputs`), read from its
  ``init`` on the flat ``shards`` (traced, nothing runs), before its state
  is placed."""
  state = placement.init_shapes(tx, shards, mesh, params_spec=P(shard_axis))
  check_shard_outputs(state, shard_axis, copies_over=copies_over)


def check_shard_outputs(opt_state, shard_axis, copies_over=None) -> None:
  named = optimizers.compressed_optimizers_in(opt_state)
  if named:
    fix = ("layout=jaxcomp.Islands()" if named[0] == "zero_one_adam"
           else "layout=jaxcomp.DataParallel()")
    raise ValueError(
        f"tx holds jaxcomp.{named[0]}, which keeps whole replicated "
        "parameters, momentum and variance and runs its own exchange of "
        "the whole momentum: an FSDP layout cannot shard it. Train it with "
        f"{fix}")
  if holds_diloco(opt_state) and copies_over is None:
    raise ValueError(
        "tx holds jaxcomp.diloco, which FSDP cannot shard over the devices "
        "that DiLoCo averages: DiLoCo keeps one whole copy of the parameters "
        "per worker between syncs. Train it with layout=jaxcomp.Islands(), "
        "or as islands with FSDP inside each: layout=jaxcomp.Islands("
        "over=<the islands' axis>, inside=jaxcomp.FSDP(shard_axis=<the "
        "island's axis>))")
  configs = transform.transform_configs(opt_state)
  shard = {path: c for path, c in configs.items() if c.get("output") == "shard"}
  if not shard:
    where = (f"; the compressed_mean at state{next(iter(configs))} averages "
             "whole gradients (output='mean')" if configs else "")
    raise ValueError(
        "tx has no jaxcomp.compressed_mean(..., output='shard'): the "
        "gradient of the whole parameters must be reduce-scattered into "
        "shards before the optimizer (for a dense exchange, "
        f"compressed_mean('identity', {shard_axis!r}, output='shard')){where}")
  want = _mesh.axes(shard_axis)
  for path, c in shard.items():
    axes = c["axis_name"]
    if tuple([axes] if isinstance(axes, str) else axes) != want:
      raise ValueError(
          f"the compressed_mean at state{path} reduce-scatters over {axes!r} "
          f"but the parameters are sharded over {shard_axis!r}")


def state_bytes(tree: Any) -> int:
  """Bytes of the arrays in ``tree`` held on one device (global arrays:
  their addressable shard on the first device)."""
  total = 0
  for x in jax.tree.leaves(tree):
    if isinstance(x, jax.Array) and hasattr(x, "addressable_shards"):
      total += x.addressable_shards[0].data.nbytes
    else:
      total += x.size * jnp.dtype(x.dtype).itemsize
  return total
