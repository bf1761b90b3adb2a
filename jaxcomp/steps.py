"""One family of train steps: state placement and the step for every layout
of the parameters.

A *layout* says where the parameters live and how a device takes its own
gradient of them; everything else about a step is the same for all of
them::

  per device, under jax.shard_map over the mesh:
    params = layout.enter(params)                   # this device's view
    out, grads = layout.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = layout.after_update(params + updates, opt_state)
    return layout.leave(params), opt_state, loss averaged over the data axes

The layouts:

* :class:`DataParallel`: the parameters replicated (or placed by a spec:
  tensor parallelism written per device); a device's gradient is of its
  copy, marked varying (:func:`jaxcomp.per_device_value_and_grad`).
* :class:`jaxcomp.fsdp.FSDP`: flat shards over the data (or a host's)
  axis; a device's gradient is of the gathered parameters
  (:mod:`jaxcomp.fsdp`).
* :class:`jaxcomp.lowcomm.PerDevice`: one copy per device, a leading device
  axis; a device's gradient is of its own copy (DiLoCo).

Each layout lives with its concept (FSDP's in :mod:`jaxcomp.fsdp`,
DiLoCo's in :mod:`jaxcomp.lowcomm`); this module holds the base, the
replicated layout and the step. The entry points built on it
(:func:`jaxcomp.make_train_step`, :func:`jaxcomp.fsdp.make_train_step`,
:func:`jaxcomp.lowcomm.make_train_step`, :func:`jaxcomp.lowcomm.local_step`,
:func:`jaxcomp.flax.train_step`, :func:`jaxcomp.compressed_value_and_grad`)
differ in their layout and in how they hand the step to the user, not in
the step: every one runs :func:`per_device_step`'s body.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import optax

from jaxcomp import placement
from jaxcomp._mesh import AxisName
from jaxcomp.placement import check_mesh_axes
from jaxcomp.placement import init_sharded
from jaxcomp.placement import to_global
from jaxcomp.placement import to_local


# -- Layouts ----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Layout:
  """Base of the layouts: where the parameters live on the mesh and how a
  device takes its own gradient of them (see the module docstring)."""

  def params_spec(self, axis_name: AxisName):
    """The parameters' partition spec(s) under ``shard_map`` (a prefix of
    their tree)."""
    del axis_name
    return P()

  def value_and_grad(self, loss_fn: Callable, axis_name: AxisName, *,
                     has_aux: bool = False) -> Callable:
    """``f(params, *args) -> (value, grads)`` inside ``shard_map``: this
    device's own gradient (varying over ``axis_name``)."""
    return placement.per_device_value_and_grad(loss_fn, axis_name,
                                               has_aux=has_aux)

  def enter(self, params):
    """The parameters as the step body uses them (inside ``shard_map``)."""
    return params

  def after_update(self, params, opt_state):
    """The parameters after ``optax.apply_updates``."""
    del opt_state
    return params

  def leave(self, params):
    """The parameters as ``shard_map`` returns them."""
    return params

  def place(self, tx, params, mesh, axis_name: AxisName):
    """``(params, opt_state, specs)``: the parameters placed on ``mesh`` as
    this layout holds them, and ``tx``'s state with its partition specs."""
    raise NotImplementedError


@dataclasses.dataclass(frozen=True)
class DataParallel(Layout):
  """Every device holds the parameters, replicated, or placed by
  ``params_spec`` inside ``shard_map`` (tensor-parallel leaves sharded over a
  ``model`` axis, the loss written for the local shards with its own
  collectives: ``lax.psum(h @ w2, "model")``).

  Args:
    spec: the parameters' partition spec(s): ``P()`` (replicated, the
      default), one spec for every leaf, or a pytree of specs.
  """

  spec: Any = P()

  def params_spec(self, axis_name):
    del axis_name
    return self.spec

  def place(self, tx, params, mesh, axis_name):
    state, specs = init_sharded(tx, params, mesh, axis_name,
                                params_spec=self.spec)
    placed = jax.device_put(params, jax.tree.map(
        lambda s: NamedSharding(mesh, s), self.spec,
        is_leaf=lambda x: isinstance(x, P)))
    return placed, state, specs



def init(tx, params, mesh, axis_name: AxisName = "data", *,
         layout: Layout = DataParallel()):
  """Places ``params`` on ``mesh`` as ``layout`` holds them and initialises
  ``tx``'s state there.

  Returns:
    ``(params, opt_state, specs)``: the placed parameters, the state and
    its partition specs (for :func:`make_train_step`).

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; what the layout
      refuses (FSDP without a reduce-scattering transform, DiLoCo on FSDP).
  """
  check_mesh_axes(mesh, axis_name)
  return layout.place(tx, params, mesh, axis_name)


# -- The step ---------------------------------------------------------------


def step_loss(out, axis_name: AxisName, per_device_loss: bool):
  """Inside a train step: the loss (and aux) averaged over ``axis_name``, or
  with ``per_device_loss`` each device's own with a leading axis, to be
  returned with ``out_aux_spec=P(axis_name)`` (no collective)."""
  return jax.tree.map(
      (lambda v: v[None]) if per_device_loss
      else (lambda v: lax.pmean(v, axis_name)), out)


def shard_train_step(step_fn: Callable, *, mesh, state_specs,
                     batch_spec: Any, params_spec: Any = P(),
                     out_aux_spec: Any = P()) -> Callable:
  """Wraps a per-device train step with ``jax.shard_map``.

  Args:
    step_fn: ``step_fn(params, opt_state, batch) -> (params, opt_state, aux)``
      written per device: ``opt_state`` is the local view (no device axis),
      and ``aux`` must be invariant (e.g. a ``lax.pmean`` of the loss).
    mesh: the mesh.
    state_specs: the specs returned by :func:`jaxcomp.init_sharded`.
    batch_spec: partition spec(s) of the batch, e.g. ``P("data")``.
    params_spec: partition spec(s) of the parameters (replicated by default).
    out_aux_spec: partition spec(s) of ``aux``.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, aux)`` on global
    arrays; wrap it in ``jax.jit`` (with ``donate_argnums=(0, 1)``).

  Example:
    A step written per device, as :func:`make_train_step` writes it:

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
    ...                  optax.sgd(0.1))
    >>> params = {"w": jnp.zeros((4,))}
    >>> opt_state, specs = jaxcomp.init_sharded(tx, params, mesh, "data")
    >>> def step_fn(params, opt_state, batch):  # one device's view
    ...   x, y = batch
    ...   loss_fn = lambda p: jnp.mean((x @ p["w"] - y) ** 2)
    ...   loss, grads = jaxcomp.per_device_value_and_grad(loss_fn, "data")(
    ...       params)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   params = optax.apply_updates(params, updates)
    ...   return params, opt_state, jax.lax.pmean(loss, "data")
    >>> step = jax.jit(jaxcomp.shard_train_step(
    ...     step_fn, mesh=mesh, state_specs=specs, batch_spec=P("data")))
    >>> n = 4 * jax.device_count()
    >>> batch = jax.device_put((jnp.ones((n, 4)), jnp.ones((n,))),
    ...                        NamedSharding(mesh, P("data")))
    >>> params = jax.device_put(params, NamedSharding(mesh, P()))
    >>> params, opt_state, loss = step(params, opt_state, batch)
    >>> float(loss)
    1.0
    >>> params["w"]  # top-k sent half of the gradient, the rest is residual
    Array([0.2, 0.2, 0. , 0. ], dtype=float32)
  """

  def body(params, opt_state, batch):
    params, opt_state, aux = step_fn(params, to_local(opt_state, state_specs),
                                     batch)
    return params, to_global(opt_state, state_specs), aux

  return jax.shard_map(
      body, mesh=mesh, in_specs=(params_spec, state_specs, batch_spec),
      out_specs=(params_spec, state_specs, out_aux_spec))


def _model_state_mean(state, axis_name: AxisName):
  """The model state a forward pass changed (BatchNorm statistics), its
  floating leaves averaged over ``axis_name``, the others as they are."""
  return jax.tree.map(
      lambda x: lax.pmean(x, axis_name)
      if jnp.issubdtype(jnp.result_type(x), jnp.floating) else x, state)


def per_device_step(loss_fn: Callable, tx, *, mesh, state_specs,
                    layout: Layout = DataParallel(),
                    axis_name: AxisName = "data", batch_spec: Any = None,
                    has_aux: bool = False, per_device_loss: bool = False,
                    value_and_grad: Callable | None = None,
                    has_state: bool = False,
                    apply_updates: bool = True) -> Callable:
  """The step of every layout on global arrays (``shard_map``'d, not
  jitted): the one step body of jaxcomp (see the module docstring).
  :func:`make_train_step` jits it; :func:`jaxcomp.lowcomm.local_step` calls
  it inside a user's own jit; :func:`jaxcomp.flax.train_step` runs an NNX
  model through it and :class:`CompressedValueAndGrad` takes its averaged
  gradient.

  ``loss_fn``, ``tx``, ``mesh``, ``state_specs``, ``layout``,
  ``axis_name``, ``batch_spec``, ``has_aux`` and ``per_device_loss`` are
  :func:`make_train_step`'s.

  Args:
    value_and_grad: ``value_and_grad(loss_fn, axis_name, has_aux=...)``,
      where given, replaces the layout's per-device gradient.
    has_state: ``loss_fn(params, batch)`` returns ``(out, model_state)``:
      ``out`` the loss (or ``(loss, aux)`` with ``has_aux``), and
      ``model_state`` what the forward pass changed besides the parameters
      (BatchNorm statistics, an NNX model's other variables), whose
      floating leaves the step averages over ``axis_name`` and returns
      replicated: the aux output is then ``(out, model_state)``.
    apply_updates: False: the step returns ``tx``'s updates (the averaged
      gradient, placed like the parameters) where it would return the new
      parameters.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, out)``.
  """
  check_mesh_axes(mesh, axis_name)
  make_grad = value_and_grad or layout.value_and_grad
  if has_state:
    def loss_and_state(params, batch):
      out, model_state = loss_fn(params, batch)
      return (out[0] if has_aux else out), (out, model_state)
    grad_fn = make_grad(loss_and_state, axis_name, has_aux=True)
  else:
    grad_fn = make_grad(loss_fn, axis_name, has_aux=has_aux)

  def step_fn(params, opt_state, batch):
    params = layout.enter(params)
    out, grads = grad_fn(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    if apply_updates:
      params = layout.leave(layout.after_update(
          optax.apply_updates(params, updates), opt_state))
    else:
      params = updates
    if has_state:
      (_, (out, model_state)) = out
      return params, opt_state, (step_loss(out, axis_name, per_device_loss),
                                 _model_state_mean(model_state, axis_name))
    return params, opt_state, step_loss(out, axis_name, per_device_loss)

  loss_spec = P(axis_name) if per_device_loss else P()
  return shard_train_step(
      step_fn, mesh=mesh, state_specs=state_specs,
      batch_spec=P(axis_name) if batch_spec is None else batch_spec,
      params_spec=layout.params_spec(axis_name),
      out_aux_spec=(loss_spec, P()) if has_state else loss_spec)


def make_train_step(loss_fn: Callable, tx, *, mesh, state_specs,
                    axis_name: AxisName = "data", batch_spec: Any = None,
                    has_aux: bool = False, donate: bool = True,
                    per_device_loss: bool = False, params_spec: Any = P(),
                    value_and_grad: Callable | None = None,
                    layout: Layout | None = None) -> Callable:
  """The data-parallel train step, compiled: per-device gradient, ``tx``'s
  compressed update, parameters updated, loss averaged.

  Per device, under ``jax.shard_map`` over ``mesh``::

    loss, grads = per_device_value_and_grad(loss_fn, axis_name)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, lax.pmean(loss, axis_name)

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (a float32 scalar, this
      device's mean over its share of the batch), or ``(loss, aux)`` with
      ``has_aux``.
    tx: the optimizer, containing jaxcomp transforms over ``axis_name``.
    mesh: the device mesh.
    state_specs: the specs :func:`jaxcomp.init_sharded` returned with the
      state.
    axis_name: the data-parallel axis (or tuple of axes).
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``
      (every leaf split over the devices along its first dimension).
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is then
      averaged over ``axis_name`` too (every leaf must be a float array).
    donate: donate the parameters' and the state's buffers to the step.
    per_device_loss: return each device's own loss (and aux), stacked on a
      leading device axis, instead of their mean: the step then runs no
      collective besides the transform's (benchmarks that time it).
    params_spec: partition spec(s) of the parameters (replicated by
      default): :class:`DataParallel`'s ``spec``.
    value_and_grad: builds the per-device gradient function,
      ``value_and_grad(loss_fn, axis_name, has_aux=...)``; default the
      layout's.
    layout: where the parameters live (:class:`DataParallel`,
      :class:`jaxcomp.fsdp.FSDP`, :class:`jaxcomp.lowcomm.PerDevice`); default ``DataParallel(
      params_spec)``.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, loss)`` (or
    ``(params, opt_state, (loss, aux))``) on global arrays, jitted;
    ``batch`` must be placed on ``mesh`` with ``batch_spec``
    (``jax.device_put(batch, NamedSharding(mesh, P("data")))``).

  Raises:
    ValueError: as :func:`jaxcomp.init_sharded`, for a bad ``axis_name``.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def loss_fn(params, batch):
    ...   x, y = batch
    ...   return jnp.mean((x @ params["w"] - y) ** 2)
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
    ...                  optax.sgd(0.1))
    >>> params = {"w": jnp.zeros((4,))}
    >>> state, specs = jaxcomp.init_sharded(tx, params, mesh, "data")
    >>> step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh,
    ...                                state_specs=specs)
    >>> n = 4 * jax.device_count()
    >>> batch = jax.device_put((jnp.ones((n, 4)), jnp.ones((n,))),
    ...                        NamedSharding(mesh, P("data")))
    >>> params = jax.device_put(params, NamedSharding(mesh, P()))
    >>> params, state, loss = step(params, state, batch)
    >>> float(loss)
    1.0
  """
  layout = DataParallel(params_spec) if layout is None else layout
  step = per_device_step(loss_fn, tx, mesh=mesh, state_specs=state_specs,
                         layout=layout, axis_name=axis_name,
                         batch_spec=batch_spec, has_aux=has_aux,
                         per_device_loss=per_device_loss,
                         value_and_grad=value_and_grad)
  return jax.jit(step, donate_argnums=(0, 1) if donate else ())
