"""FSDP's train steps: the parameters sharded and the state placed, and the
compiled step; each the :class:`FSDP` layout of the one step
family."""

from __future__ import annotations

from collections.abc import Callable

from jax.sharding import PartitionSpec as P

from jaxcomp import steps
from jaxcomp.fsdp._layout import FSDP
from jaxcomp.fsdp._shards import check_transform
from jaxcomp.fsdp._shards import shapes_of
from jaxcomp.fsdp._shards import shard_params
from jaxcomp._mesh import AxisName
from jaxcomp.lowcomm._layout import PerDevice
from jaxcomp.placement import init_sharded


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
        tx, params, mesh, axis_name, layout=PerDevice(
            copies_over, FSDP(shapes, shard_axis)))
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
  layout = FSDP(shapes, shard_axis, param_compressor)
  if copies_over is not None:
    layout = PerDevice(copies_over, FSDP(
        shapes, axis_name if shard_axis is None else shard_axis,
        param_compressor))
  return steps.make_train_step(
      loss_fn, tx, mesh=mesh, state_specs=state_specs, axis_name=axis_name,
      layout=layout, **kwargs)
