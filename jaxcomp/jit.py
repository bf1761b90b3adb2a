"""Compression for ``jax.jit`` steps: :func:`compressed_value_and_grad`, the
averaged gradient of a loss through a compressed exchange, for training
steps that let XLA partition the batch (no hand-written per-device step),
with the parameters replicated, sharded by GSPMD over model axes, or held
as FSDP's flat shards. Its per-device gradient and exchange are the one
step body's (:func:`jaxcomp.steps.per_device_step`)."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from jaxcomp import _mesh
from jaxcomp import placement
from jaxcomp._mesh import AxisName
from jaxcomp.fsdp._layout import FSDP
from jaxcomp.fsdp._shards import check_transform
from jaxcomp.placement import check_mesh_axes
from jaxcomp.placement import init_sharded
from jaxcomp.steps import DataParallel
from jaxcomp.steps import Layout
from jaxcomp.steps import per_device_step
from jaxcomp.steps import shard_train_step
from jaxcomp.steps import step_loss


def _leaf_specs_of(params, mesh, data: tuple[str, ...]):
  """Each parameter leaf's partition spec on ``mesh``, read from its
  ``NamedSharding``, for the GSPMD route.

  Raises:
    ValueError: a leaf placed on another mesh, or sharded over a data axis
      (naming the leaf and what to do instead).
  """
  def spec(path, x):
    where = jax.tree_util.keystr(path) or "(root)"
    sharding = getattr(x, "sharding", None)
    if not isinstance(sharding, NamedSharding):
      return P()  # uncommitted or on one device: placed replicated
    if sharding.mesh.shape_tuple != mesh.shape_tuple:
      raise ValueError(
          f"parameter {where} is placed on mesh {dict(sharding.mesh.shape)}, "
          f"not on the step's mesh {dict(mesh.shape)}: place every parameter "
          "on the mesh given to compressed_value_and_grad")
    s = sharding.spec
    used = {a for dim in s if dim is not None
            for a in ((dim,) if isinstance(dim, str) else dim)}
    if used & set(data):
      raise ValueError(
          f"parameter {where} is sharded over the data axis "
          f"{sorted(used & set(data))} ({s}): the compressed mean averages "
          "each device's whole gradient over the data axes, so its "
          "parameters must be replicated over them. Shard it over model "
          "axes only, or use FSDP's flat shards: "
          "compressed_value_and_grad(..., shapes=jaxcomp.fsdp.shard_params("
          "params, mesh)[1]) with compressed_mean(..., output='shard')")
    return P(*s, *([None] * (jnp.ndim(x) - len(s))))

  return jax.tree_util.tree_map_with_path(spec, params)


_DATA_AXIS_IN_LOSS = ("Axes mentioned in manual_axis_type", "manual")


class CompressedValueAndGrad:
  """``jax.value_and_grad`` for ``jax.jit`` steps on sharded batches, with
  the gradient averaged by a compressed exchange.

  A ``jax.jit`` train step that lets XLA partition the batch (no
  hand-written per-device step) adopts compression by changing its
  gradient line: this runs ``loss_fn``'s per-device gradient and
  ``transform`` (e.g. ``jaxcomp.compressed_mean("topk", "data")``) under
  ``jax.shard_map`` over ``mesh`` and returns the averaged gradient with
  the transform's state threaded through::

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

  **Parameters GSPMD shards over model axes** (tensor parallelism, the
  MaxText / Levanter layout). Where the mesh has axes besides
  ``axis_name``, ``init`` reads each parameter's ``NamedSharding``, and the
  step runs in two parts: ``loss_fn``, written for the global arrays as in
  a plain ``jax.jit`` step, runs under ``jax.shard_map`` manual over the
  data axes only, so GSPMD partitions it over the model axes as it would
  without jaxcomp (the same per-device flops, the same model-axis
  collectives); its gradient, varying over the data axes, is then
  compressed by each device on its own local shard of every leaf (a
  ``shard_map`` manual over every axis; the transform averages over the
  data axes only), so nothing is gathered over the model axes for
  compression, and the mean comes back with the parameters' shardings.
  The mesh's non-data axes should be ``AxisType.Auto`` (GSPMD's); a
  sharding constraint in ``loss_fn`` may not name a data axis (the batch
  is already this device's share there): write ``P(None, "model")`` where
  ``P("data", "model")`` was.

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
    ValueError: ``axis_name`` is empty or not an axis of ``mesh``; in
      ``init``, a parameter sharded over a data axis (without ``shapes``)
      or placed on another mesh, naming it; in the call, a sharding
      constraint in ``loss_fn`` that names a data axis, saying what to
      write instead.

  Example:
    Called outside ``jax.jit`` too (each call then compiles); in a step,
    as :func:`compressed_value_and_grad` shows:

    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch @ params["w"]) ** 2)
    >>> grad_fn = jaxcomp.CompressedValueAndGrad(
    ...     loss_fn, jaxcomp.compressed_mean("bf16", "data"), mesh)
    >>> params = {"w": jnp.ones((4,))}
    >>> comp_state = grad_fn.init(params)
    >>> batch = jax.device_put(jnp.ones((2 * jax.device_count(), 4)),
    ...                        NamedSharding(mesh, P("data")))
    >>> (loss, grads), comp_state = grad_fn(params, comp_state, batch)
    >>> float(loss), grads["w"]
    (16.0, Array([8., 8., 8., 8.], dtype=float32))
    >>> float(jaxcomp.get_stats(comp_state).compression_factor)  # bfloat16
    2.0
  """

  def __init__(self, loss_fn: Callable, transform, mesh, *,
               axis_name: AxisName = "data", batch_spec: Any = None,
               has_aux: bool = False, shapes=None,
               shard_axis: AxisName | None = None):
    check_mesh_axes(mesh, axis_name)
    self.loss_fn, self.has_aux = loss_fn, has_aux
    self.transform, self.mesh, self.axis_name = transform, mesh, axis_name
    self.batch_spec = P(axis_name) if batch_spec is None else batch_spec
    self.shapes = shapes
    self.shard_axis = axis_name if shard_axis is None else shard_axis
    self._data = _mesh.axes(axis_name)
    self.layout: Layout = (DataParallel() if shapes is None
                           else FSDP(shapes, self.shard_axis))
    # GSPMD: the mesh has axes the transform does not average over.
    self.gspmd = shapes is None and any(
        a not in self._data and mesh.shape[a] > 1 for a in mesh.axis_names)
    self.specs = None

  @property
  def params_spec(self):
    """The parameters' partition spec(s) under ``shard_map`` (the layout's;
    GSPMD: each leaf's, read by :meth:`init`)."""
    return self.layout.params_spec(self.axis_name)

  def init(self, params):
    """The transform's state for ``params``, placed on the mesh (per-device
    leaves with a leading device axis, see :func:`jaxcomp.init_sharded`).
    FSDP (``shapes`` given): ``params`` are the flat shards of
    :func:`jaxcomp.fsdp.shard_params`. GSPMD: ``params`` carry their
    ``NamedSharding`` s, which the step keeps.

    Raises:
      ValueError: with ``shapes``, no ``compressed_mean(...,
        output="shard")`` over ``shard_axis`` in the transform; without,
        a parameter the GSPMD route cannot keep (see the class).
    """
    placement.check_array_leaves(params)
    if self.gspmd:  # the layout of the leaves GSPMD shards over model axes
      self.layout = DataParallel(_leaf_specs_of(params, self.mesh, self._data))
    if self.shapes is not None:
      check_transform(self.transform, params, self.mesh, self.shard_axis)
    state, self.specs = init_sharded(self.transform, params, self.mesh,
                                     self.axis_name,
                                     params_spec=self.params_spec,
                                     grads=self.shapes)
    return state

  def __call__(self, params, state, batch):
    """``((loss, grads), state)``: the loss (and aux) averaged over the
    devices, the compressed mean of the per-device gradients (placed like
    the parameters), and the transform's new state."""
    if self.specs is None:
      raise ValueError("call init(params) first: it places the transform's "
                       "state on the mesh and derives its partition specs")
    if self.gspmd:
      return self._gspmd_call(params, state, batch)
    mean, state, out = per_device_step(
        self.loss_fn, self.transform, mesh=self.mesh, state_specs=self.specs,
        layout=self.layout, axis_name=self.axis_name,
        batch_spec=self.batch_spec, has_aux=self.has_aux,
        apply_updates=False)(params, state, batch)
    return (out, mean), state

  def _gspmd_call(self, params, state, batch):
    """The loss for global arrays under ``shard_map`` manual over the data
    axes (GSPMD partitions it over the model axes), then the transform on
    each device's local shards of the per-device gradients."""
    data = self._data
    data_spec = data[0] if len(data) == 1 else data
    grad_fn = self.layout.value_and_grad(self.loss_fn, self.axis_name,
                                         has_aux=self.has_aux)

    def per_device(params, batch):
      out, grads = grad_fn(params, batch)
      return (step_loss(out, self.axis_name, False),
              jax.tree.map(lambda g: g[None], grads))

    try:
      out, grads = jax.shard_map(
          per_device, mesh=self.mesh, in_specs=(P(), self.batch_spec),
          out_specs=(P(), P(data_spec)), axis_names=set(data))(params, batch)
    except ValueError as e:
      if any(s in str(e) for s in _DATA_AXIS_IN_LOSS):
        raise ValueError(
            f"a sharding constraint in loss_fn names the data axis "
            f"{self.axis_name!r}: inside compressed_value_and_grad the batch "
            "is already this device's share along it (the per-device "
            "gradient runs manual over the data axes). Leave the data axis "
            "out of the constraint, e.g. with_sharding_constraint(h, "
            "P(None, 'model')) for P('data', 'model')") from e
      raise

    def compress(params, state, grads):
      grads = jax.tree.map(lambda g: g[0], grads)
      mean, state = self.transform.update(grads, state, params)
      return mean, state, ()

    stacked = jax.tree.map(lambda s: P(data_spec, *s), self.params_spec,
                           is_leaf=lambda x: isinstance(x, P))
    mean, state, _ = shard_train_step(
        compress, mesh=self.mesh, state_specs=self.specs, batch_spec=stacked,
        params_spec=self.params_spec, out_aux_spec=())(params, state, grads)
    return (out, mean), state


def compressed_value_and_grad(loss_fn: Callable, transform, mesh, *,
                              axis_name: AxisName = "data",
                              batch_spec: Any = None,
                              has_aux: bool = False, shapes=None,
                              shard_axis: AxisName | None = None
                              ) -> CompressedValueAndGrad:
  """:class:`CompressedValueAndGrad`: the averaged gradient of ``loss_fn`` through
  ``transform``'s compressed exchange, for ``jax.jit`` steps (parameters
  replicated, GSPMD-sharded over model axes, or FSDP flat shards).

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
                      batch_spec=batch_spec, has_aux=has_aux, shapes=shapes,
                      shard_axis=shard_axis)

