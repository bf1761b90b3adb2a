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

from collections.abc import Callable

from jax.sharding import PartitionSpec as P

from jaxcomp import steps
from jaxcomp._fsdp import check_transform
from jaxcomp._fsdp import gather_params
from jaxcomp._fsdp import shapes_of
from jaxcomp._fsdp import shard_params
from jaxcomp._fsdp import state_bytes
from jaxcomp._fsdp import unshard_params
from jaxcomp._fsdp import value_and_grad
from jaxcomp._mesh import AxisName
from jaxcomp.placement import init_sharded

__all__ = ["gather_params", "init", "make_train_step", "shard_params",
           "state_bytes", "unshard_params", "value_and_grad"]


def init(tx, params, mesh, axis_name: AxisName = "data", *,
         shard_axis: AxisName | None = None,
         copies_over: AxisName | None = None):
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
    copies_over: DiLoCo across islands with FSDP inside each: the islands'
      axis (``"hosts"`` on a ``("hosts", "data")`` mesh, ``shard_axis=
      "data"``), with ``tx = jaxcomp.diloco(optax.chain(
      jaxcomp.compressed_mean("identity", "data", output="shard"), inner),
      ..., axis_name="hosts")``: each island holds one copy of the
      parameters as flat shards over its devices, steps it as FSDP does,
      and every ``sync_every`` steps each device exchanges its shard of the
      pseudo-gradient with the devices holding that shard in the other
      islands (compressed as DiLoCo's ``compressor`` says).

  Returns:
    ``(shards, shapes, opt_state, specs)``: as :func:`shard_params`, and the
    state with its partition specs as :func:`jaxcomp.init_sharded` returns
    them (the optimizer's moments are per-device shards, ``P(axis_name)``).
    With ``copies_over``, ``shards`` has one copy per island, each leaf
    ``(islands, p * c)`` placed ``P(copies_over, shard_axis)``, and
    :func:`jaxcomp.lowcomm.synced_params` of the state is the anchor's
    shards (``unshard_params(synced_params(opt_state), shapes)`` makes it
    whole).

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; no jaxcomp
      transform in ``tx`` with ``output="shard"`` over ``shard_axis`` (the
      optimizer would get whole gradients for shard-shaped parameters); a
      :func:`jaxcomp.diloco` in ``tx`` without ``copies_over``; with it,
      a ``shard_axis`` that overlaps ``copies_over`` or is not among
      ``axis_name``.

  ``jaxcomp.multi_steps`` around ``tx`` accumulates the whole gradient per
  device (flat, padded to the shards' whole size: one whole-gradient
  float32 buffer per device, as PyTorch FSDP's ``no_sync`` keeps unsharded
  gradients) and reduce-scatters once per ``every_k`` micro-steps.
  """
  shard_axis = axis_name if shard_axis is None else shard_axis
  if copies_over is not None:
    shapes = shapes_of(params)
    copies, state, specs = steps.init(
        tx, params, mesh, axis_name, layout=steps.PerDevice(
            copies_over, steps.FSDP(shapes, shard_axis)))
    return copies, shapes, state, specs
  shards, shapes = shard_params(params, mesh, shard_axis)
  check_transform(tx, shards, mesh, shard_axis)
  state, specs = init_sharded(tx, shards, mesh, axis_name,
                              params_spec=P(shard_axis), grads=shapes)
  return shards, shapes, state, specs


def make_train_step(loss_fn: Callable, tx, shapes, *, mesh, state_specs,
                    axis_name: AxisName = "data",
                    shard_axis: AxisName | None = None,
                    param_compressor=None,
                    copies_over: AxisName | None = None,
                    **kwargs) -> Callable:
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
    copies_over: DiLoCo islands with FSDP inside, as :func:`init` placed
      them.
    **kwargs: :func:`jaxcomp.make_train_step`'s other options
      (``batch_spec``, ``has_aux``, ``donate``, ``per_device_loss``).

  Returns:
    ``step(shards, opt_state, batch) -> (shards, opt_state, loss)``, jitted.
  """
  layout = steps.FSDP(shapes, shard_axis, param_compressor)
  if copies_over is not None:
    layout = steps.PerDevice(copies_over, steps.FSDP(
        shapes, axis_name if shard_axis is None else shard_axis,
        param_compressor))
  return steps.make_train_step(
      loss_fn, tx, mesh=mesh, state_specs=state_specs, axis_name=axis_name,
      layout=layout, **kwargs)
