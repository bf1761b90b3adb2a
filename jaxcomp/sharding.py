"""The ``jax.jit`` idiom: a step that lets XLA partition the batch adopts
compression by changing its gradient line (:func:`compressed_value_and_grad`).

The helpers that place state and build ``shard_map`` steps live in
:mod:`jaxcomp.placement`; their names are re-exported here as before.
"""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp import fsdp
from jaxcomp._mesh import AxisName
from jaxcomp.placement import check_mesh_axes
from jaxcomp.placement import init_sharded
from jaxcomp.placement import make_train_step
from jaxcomp.placement import per_device_grad
from jaxcomp.placement import per_device_value_and_grad
from jaxcomp.placement import shard_train_step
from jaxcomp.placement import state_partition_specs
from jaxcomp.placement import step_loss
from jaxcomp.placement import to_global
from jaxcomp.placement import to_local
from jaxcomp._mesh import to_varying
from jaxcomp._mesh import varying_axes

__all__ = [
    "CompressedValueAndGrad", "compressed_value_and_grad", "init_sharded",
    "make_train_step", "per_device_grad", "per_device_value_and_grad",
    "shard_train_step", "state_partition_specs", "step_loss", "to_global",
    "to_local", "to_varying", "varying_axes",
]


class CompressedValueAndGrad:
  """``jax.value_and_grad`` for ``jax.jit`` steps on sharded batches, with
  the gradient averaged by a compressed exchange.

  A ``jax.jit`` train step that lets XLA partition the batch (no
  hand-written per-device step) adopts compression by changing its
  gradient line: this runs ``loss_fn``'s per-device gradient and
  ``transform`` (e.g. ``jaxcomp.compressed_mean("topk", "data")``) under
  ``jax.shard_map`` over ``mesh`` and returns the averaged gradient,
  replicated, with the transform's state threaded through::

    grad_fn = jaxcomp.compressed_value_and_grad(
        loss_fn, jaxcomp.compressed_mean("topk", "data", ratio=0.01), mesh)
    comp_state = grad_fn.init(params)

    @jax.jit
    def train_step(params, opt_state, comp_state, batch):
      (loss, grads), comp_state = grad_fn(params, comp_state, batch)
      updates, opt_state = optimizer.update(grads, opt_state, params)
      return optax.apply_updates(params, updates), opt_state, comp_state, loss

  The optimizer runs outside ``shard_map`` on the averaged gradient, as in
  the uncompressed step.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (this device's mean over
      its share of the batch), or ``(loss, aux)`` with ``has_aux``.
    transform: a jaxcomp transform over ``axis_name`` (or a chain of them).
    mesh: the device mesh.
    axis_name: the data-parallel axis (or tuple of axes).
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is then
      averaged over ``axis_name`` too.
    shapes: FSDP: the parameters' shapes from
      :func:`jaxcomp.fsdp.shard_params`. ``params`` are then the global flat
      shards (``P(shard_axis)``), gathered for ``loss_fn``; ``transform``
      reduce-scatters (``compressed_mean(..., output="shard")``) and the
      gradient returned is the mean's flat shards, placed like the
      parameters, so an optimizer initialised on the shards keeps its
      moments sharded as well (``jax.jit`` partitions its elementwise
      update).
    shard_axis: FSDP: the axis the parameters are sharded over (default
      ``axis_name``; HSDP: the fast axis).

  Raises:
    ValueError: ``axis_name`` is empty or not an axis of ``mesh``.
  """

  def __init__(self, loss_fn: Callable, transform, mesh, *,
               axis_name: AxisName = "data", batch_spec: Any = None,
               has_aux: bool = False, shapes=None,
               shard_axis: AxisName | None = None):
    check_mesh_axes(mesh, axis_name)
    self.transform, self.mesh, self.axis_name = transform, mesh, axis_name
    self.batch_spec = P(axis_name) if batch_spec is None else batch_spec
    self.shapes = shapes
    self.shard_axis = axis_name if shard_axis is None else shard_axis
    if shapes is None:
      self._grad = per_device_value_and_grad(loss_fn, axis_name,
                                             has_aux=has_aux)
      self.params_spec = P()
    else:
      self._grad = fsdp.value_and_grad(loss_fn, shapes, axis_name,
                                       shard_axis=self.shard_axis,
                                       has_aux=has_aux)
      self.params_spec = P(self.shard_axis)
    self.specs = None

  def init(self, params):
    """The transform's state for ``params``, placed on the mesh (per-device
    leaves with a leading device axis, see :func:`init_sharded`). FSDP
    (``shapes`` given): ``params`` are the flat shards of
    :func:`jaxcomp.fsdp.shard_params`.

    Raises:
      ValueError: with ``shapes``, no ``compressed_mean(...,
        output="shard")`` over ``shard_axis`` in the transform.
    """
    state, self.specs = init_sharded(self.transform, params, self.mesh,
                                     self.axis_name,
                                     params_spec=self.params_spec,
                                     grads=self.shapes)
    if self.shapes is not None:
      fsdp._check_shard_outputs(state, self.shard_axis)  # pylint: disable=protected-access
    return state

  def __call__(self, params, state, batch):
    """``((loss, grads), state)``: the loss (and aux) averaged over the
    devices, the compressed mean of the per-device gradients (replicated),
    and the transform's new state."""
    if self.specs is None:
      raise ValueError("call init(params) first: it places the transform's "
                       "state on the mesh and derives its partition specs")

    def body(params, state, batch):
      out, grads = self._grad(params, batch)
      mean, state = self.transform.update(grads, to_local(state, self.specs),
                                          params)
      out = jax.tree.map(lambda v: jax.lax.pmean(v, self.axis_name), out)
      return (out, mean), to_global(state, self.specs)

    return jax.shard_map(
        body, mesh=self.mesh,
        in_specs=(self.params_spec, self.specs, self.batch_spec),
        out_specs=((P(), self.params_spec), self.specs))(params, state, batch)


def compressed_value_and_grad(loss_fn: Callable, transform, mesh, *,
                              axis_name: AxisName = "data",
                              batch_spec: Any = None,
                              has_aux: bool = False, shapes=None,
                              shard_axis: AxisName | None = None
                              ) -> CompressedValueAndGrad:
  """:class:`CompressedValueAndGrad`: the averaged gradient of ``loss_fn``
  through ``transform``'s compressed exchange, for ``jax.jit`` steps.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch @ params["w"]) ** 2)
    >>> grad_fn = jaxcomp.compressed_value_and_grad(
    ...     loss_fn, jaxcomp.compressed_mean("topk", "data", ratio=0.5), mesh)
    >>> params = {"w": jnp.ones((4,))}
    >>> comp_state = grad_fn.init(params)
    >>> optimizer = optax.sgd(0.1)
    >>> opt_state = optimizer.init(params)
    >>> @jax.jit
    ... def train_step(params, opt_state, comp_state, batch):
    ...   (loss, grads), comp_state = grad_fn(params, comp_state, batch)
    ...   updates, opt_state = optimizer.update(grads, opt_state, params)
    ...   return optax.apply_updates(params, updates), opt_state, comp_state, loss
    >>> batch = jax.device_put(jnp.ones((2 * jax.device_count(), 4)),
    ...                        NamedSharding(mesh, P("data")))
    >>> params, opt_state, comp_state, loss = train_step(
    ...     params, opt_state, comp_state, batch)
    >>> float(loss)
    16.0
  """
  return CompressedValueAndGrad(loss_fn, transform, mesh, axis_name=axis_name,
                                batch_spec=batch_spec, has_aux=has_aux,
                                shapes=shapes, shard_axis=shard_axis)
