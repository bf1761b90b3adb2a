"""Sharded data parallelism (FSDP / ZeRO-3) with a compressed reduce-scatter.

Each parameter leaf of ``n`` elements is held as a *flat shard*: flattened,
zero-padded to ``p * c`` elements (``c = ceil(n / p)``, ``p`` devices on the
data axis) and split so that device ``j`` holds elements ``[j c, (j + 1) c)``
(ZeRO-3's flat partitioning). A step, per device under ``jax.shard_map``:

1. all-gather the shards into the whole parameters (:func:`gather_params`);
2. take this device's gradient of its loss with respect to the *gathered*
   parameters (:func:`value_and_grad`): per device, whole-shaped;
3. ``jaxcomp.compressed_mean(..., output="shard")`` exchanges it by a
   compressed reduce-scatter and returns this device's shard of the mean;
4. the optimizer after it updates the shards; its state is sharded too.

Parameters and optimizer state take about ``1 / p`` of the replicated
memory per device; error feedback, where used, adds one whole-gradient
float32 residual per device (``CompressionStats.state_bytes``).

The JAX fact behind step 2: inside ``shard_map``, the transpose of
``lax.all_gather`` is ``lax.psum_scatter``, so ``jax.grad`` of a loss of
gathered parameters with respect to the *shards* returns a gradient JAX has
already reduce-scattered, dense and in float32: nothing would be left to
compress. Differentiating with respect to the gathered parameters, marked
varying, keeps each device's own gradient (tests/test_fsdp.py checks both).

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxcomp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> tx = optax.chain(
  ...     jaxcomp.compressed_mean("int8_block", "data", output="shard",
  ...                             rounding="stochastic"),  # qgZ's choice
  ...     optax.sgd(0.1))
  >>> shards, shapes, state, specs = jaxcomp.fsdp.init(
  ...     tx, {"w": jnp.ones((100, 3))}, mesh)
  >>> shards["w"].shape  # 300 elements: 38 per device (8), zero-padded
  (304,)
  >>> def loss_fn(params, x):
  ...   return jnp.mean((x @ params["w"]) ** 2)
  >>> step = jaxcomp.fsdp.make_train_step(loss_fn, tx, shapes, mesh=mesh,
  ...                                     state_specs=specs)
  >>> x = jax.device_put(jnp.ones((16, 100)), NamedSharding(mesh, P("data")))
  >>> shards, state, loss = step(shards, state, x)
  >>> float(loss)
  10000.0
  >>> jaxcomp.fsdp.unshard_params(shards, shapes)["w"].shape
  (100, 3)

References:
  Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models <https://arxiv.org/abs/1910.02054>, 2020; Zhao et al.,
  PyTorch FSDP <https://arxiv.org/abs/2304.11277>, 2023; Wang et al.,
  ZeRO++ <https://arxiv.org/abs/2306.10209>, 2023 (qgZ: the quantized
  gradient reduce-scatter by all-to-all).
"""

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
from jaxcomp import placement
from jaxcomp import transform
from jaxcomp import wire
from jaxcomp.collectives.base import chunk_size
from jaxcomp._mesh import AxisName
from jaxcomp.lowcomm._diloco import holds_diloco


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
  shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(jnp.shape(x),
                                                       jnp.result_type(x)),
                        params)

  def flat(x):
    x = jnp.ravel(x)
    return jnp.pad(x, (0, p * chunk_size(x.size, p) - x.size))

  # global_array, not device_put: it works on multi-process meshes too.
  shards = distributed.global_array(jax.tree.map(flat, params), mesh,
                                    P(axis_name))
  return shards, shapes


def unshard_params(shards, shapes):
  """The whole parameters from global flat shards (outside ``shard_map``):
  each leaf's first ``n`` elements in its shape, replicated on the shards'
  mesh."""
  def one(x, s):
    if isinstance(getattr(x, "sharding", None), NamedSharding):
      x = jax.device_put(x, NamedSharding(x.sharding.mesh, P()))
    return x[:math.prod(s.shape)].reshape(s.shape)
  return jax.tree.map(one, shards, shapes)


def _param_compressor(compressor):
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
  comp = _param_compressor(compressor)

  def one(x, s):
    n = math.prod(s.shape)
    if comp is None:
      return lax.all_gather(x, axis_name, tiled=True)[:n].reshape(s.shape)
    key = jax.random.key(0)  # unused: the compressor has no randomness
    payload = comp.encode(x.astype(jnp.float32), key)
    gathered = jax.tree.map(lambda a: lax.all_gather(a, axis_name), payload)
    whole = jax.vmap(lambda pl: comp.decode(pl, x.shape[0], key))(gathered)
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
  param_comp = _param_compressor(param_compressor)
  vg = placement.per_device_value_and_grad(loss_fn, axis_name, has_aux=has_aux)
  shard_axis = axis_name if shard_axis is None else shard_axis

  def wrapped(shards, *args, **kwargs):
    return vg(gather_params(shards, shapes, shard_axis,
                            compressor=param_comp), *args, **kwargs)

  return wrapped


def init(tx, params, mesh, axis_name: AxisName = "data", *,
         shard_axis: AxisName | None = None):
  """Shards ``params`` and initialises ``tx``'s state on the shards.

  HSDP (hybrid sharding): parameters sharded over the fast axis inside a
  host and replicated across hosts, ``axis_name=("hosts", "devices"),
  shard_axis="devices"``, with ``tx`` reducing-scattering over ``devices``
  and then averaging the shards over ``hosts``::

    optax.chain(compressed_mean("identity", "devices", output="shard"),
                compressed_mean("int8_block", "hosts"), optax.adam(1e-3))

  Args:
    tx: an optax GradientTransformation with a jaxcomp transform that uses
      ``output="shard"`` over ``shard_axis``.
    params: the whole parameters.
    mesh: the device mesh.
    axis_name: the data axes (the gradients vary over them).
    shard_axis: the axis to shard the parameters over (default
      ``axis_name``).

  Returns:
    ``(shards, shapes, opt_state, specs)``: as :func:`shard_params`, and the
    state with its partition specs as :func:`jaxcomp.init_sharded` returns
    them (the optimizer's moments are per-device shards, ``P(axis_name)``).

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; no jaxcomp
      transform in ``tx`` with ``output="shard"`` over ``shard_axis`` (the
      optimizer would get whole gradients for shard-shaped parameters); a
      :func:`jaxcomp.diloco` in ``tx``.

  ``jaxcomp.multi_steps`` around ``tx`` accumulates the whole gradient per
  device (flat, padded to the shards' whole size: one whole-gradient
  float32 buffer per device, as PyTorch FSDP's ``no_sync`` keeps unsharded
  gradients) and reduce-scatters once per ``every_k`` micro-steps.
  """
  shard_axis = axis_name if shard_axis is None else shard_axis
  shards, shapes = shard_params(params, mesh, shard_axis)
  opt_state, specs = placement.init_sharded(
      tx, shards, mesh, axis_name, params_spec=P(shard_axis), grads=shapes)
  _check_shard_outputs(opt_state, shard_axis)
  return shards, shapes, opt_state, specs


def _check_shard_outputs(opt_state, shard_axis) -> None:
  if holds_diloco(opt_state):
    raise ValueError(
        "tx holds jaxcomp.diloco, which FSDP cannot shard: DiLoCo keeps one "
        "whole copy of the parameters per device between syncs. Train it "
        "replicated (jaxcomp.lowcomm.init, or jaxcomp.flax.Optimizer without "
        "fsdp=True)")
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


def make_train_step(loss_fn: Callable, tx, shapes, *, mesh, state_specs,
                    axis_name: AxisName = "data",
                    shard_axis: AxisName | None = None,
                    param_compressor=None, **kwargs) -> Callable:
  """The FSDP train step, compiled: gather, per-device gradient, ``tx``'s
  compressed reduce-scatter and update of the shards, loss averaged.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` on the whole parameters.
    tx: the optimizer (its jaxcomp transforms with ``output="shard"``).
    shapes: from :func:`shard_params` / :func:`init`.
    mesh, state_specs, axis_name: as :func:`jaxcomp.make_train_step`.
    shard_axis: the axis the parameters are sharded over (default
      ``axis_name``), as for :func:`init`.
    param_compressor: compress the parameters' forward all-gather (ZeRO++'s
      qwZ), e.g. ``"int8_block"`` (:func:`gather_params`).
    **kwargs: :func:`jaxcomp.make_train_step`'s other options
      (``batch_spec``, ``has_aux``, ``donate``, ``per_device_loss``).

  Returns:
    ``step(shards, opt_state, batch) -> (shards, opt_state, loss)``, jitted.
  """
  shard_axis = axis_name if shard_axis is None else shard_axis
  return placement.make_train_step(
      loss_fn, tx, mesh=mesh, state_specs=state_specs, axis_name=axis_name,
      params_spec=P(shard_axis),
      value_and_grad=lambda f, a, has_aux=False: value_and_grad(
          f, shapes, a, shard_axis=shard_axis,
          param_compressor=param_compressor, has_aux=has_aux), **kwargs)


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
