"""The one step body of jaxcomp and the base of its layouts.

A *layout* says where the parameters live and how a device takes its own
gradient of them; everything else about a step is the same for all of
them::

  per device, under jax.shard_map over the mesh:
    params = layout.enter(params)                   # this device's view
    out, grads = layout.value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = layout.after_update(params + updates, opt_state)
    return layout.leave(params), opt_state, loss averaged over the data axes

The layouts (:mod:`jaxcomp.layouts` lists them):

* :class:`DataParallel`: the parameters replicated (or placed by a spec:
  tensor parallelism written per device); a device's gradient is of its
  copy, marked varying (:func:`jaxcomp.per_device_value_and_grad`).
* :class:`jaxcomp.FSDP`: flat shards over the data (or a host's) axis; a
  device's gradient is of the gathered parameters (:mod:`jaxcomp.fsdp`).
* :class:`jaxcomp.Islands`: one copy per device or island, a leading
  axis; a device's gradient is of its own copy (DiLoCo).

Each layout lives with its concept (FSDP's in :mod:`jaxcomp.fsdp`,
DiLoCo's in :mod:`jaxcomp.lowcomm`); this module holds the base, the
replicated layout and the step body. Users reach the body through
:func:`jaxcomp.make_train_step` (``shard_map`` steps),
:func:`jaxcomp.compressed_value_and_grad` (``jax.jit`` steps) and
:mod:`jaxcomp.flax`; :func:`shard_train_step` is the building block of a
hand-written per-device step.
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
    """``(params, opt_state, specs, layout)``: the parameters placed on
    ``mesh`` as this layout holds them, ``tx``'s state with its partition
    specs, and the layout resolved for them (FSDP's shapes filled in)."""
    raise NotImplementedError

  def unresolved(self) -> Layout:
    """The layout as a user writes it, without what :meth:`place` filled
    in (two layouts of one configuration compare equal this way)."""
    return self

  def model_params(self, params, opt_state):
    """The whole parameters a model is evaluated with, from the placed
    ``params`` and the state (FSDP gathers its shards, DiLoCo reads its
    anchor)."""
    del opt_state
    return params


@dataclasses.dataclass(frozen=True)
class DataParallel(Layout):
  """Every device holds the parameters, replicated, or placed by
  ``params_spec`` inside ``shard_map`` (tensor-parallel leaves sharded over a
  ``model`` axis, the loss written for the local shards with its own
  collectives: ``lax.psum(h @ w2, "model")``).

  Args:
    spec: the parameters' partition spec(s): ``P()`` (replicated, the
      default), one spec for every leaf, or a pytree of specs.

  Example:
    Tensor parallelism written per device: ``w`` sharded over ``model``,
    replicated over ``data``, the gradient averaged over ``data``:

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> from jax.sharding import PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count() // 2, 2), ("data", "model"))
    >>> layout = jaxcomp.DataParallel({"w": P(None, "model")})
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data"),
    ...                  optax.sgd(0.1))
    >>> state = jaxcomp.init(tx, {"w": jnp.ones((3, 4))}, mesh, layout=layout)
    >>> state.params["w"].sharding.spec
    P(None, 'model')
  """

  spec: Any = P()

  def params_spec(self, axis_name):
    del axis_name
    return self.spec

  def place(self, tx, params, mesh, axis_name):
    state, specs = init_sharded(tx, params, mesh, axis_name,
                                params_spec=self.spec)
    # A copy: the step donates the placed parameters, which must not take
    # the caller's arrays with them (device_put keeps a buffer already on
    # one of the devices, may_alias=False or not).
    placed = jax.device_put(jax.tree.map(jnp.copy, params), jax.tree.map(
        lambda s: NamedSharding(mesh, s), self.spec,
        is_leaf=lambda x: isinstance(x, P)))
    return placed, state, specs, self



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
  """Wraps a per-device train step with ``jax.shard_map``: the building block
  of a hand-written step (:func:`jaxcomp.make_train_step` builds the usual
  one).

  Args:
    step_fn: ``step_fn(params, opt_state, batch) -> (params, opt_state, aux)``
      written per device: ``opt_state`` is the local view (no device axis),
      and ``aux`` must be invariant (e.g. a ``lax.pmean`` of the loss).
    mesh: the mesh.
    state_specs: the state's partition specs (a :class:`jaxcomp.TrainState`'s
      ``specs``, or :func:`jaxcomp.placement.init_sharded`'s).
    batch_spec: partition spec(s) of the batch, e.g. ``P("data")``.
    params_spec: partition spec(s) of the parameters (replicated by default).
    out_aux_spec: partition spec(s) of ``aux``.

  Returns:
    ``step(params, opt_state, batch) -> (params, opt_state, aux)`` on global
    arrays; wrap it in ``jax.jit`` (with ``donate_argnums=(0, 1)``).

  Example:
    A step written per device, as :func:`jaxcomp.make_train_step` writes it:

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
    ...                  optax.sgd(0.1))
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((4,))}, mesh)
    >>> def step_fn(params, opt_state, batch):  # one device's view
    ...   x, y = batch
    ...   loss_fn = lambda p: jnp.mean((x @ p["w"] - y) ** 2)
    ...   loss, grads = jaxcomp.per_device_value_and_grad(loss_fn, "data")(
    ...       params)
    ...   updates, opt_state = tx.update(grads, opt_state, params)
    ...   params = optax.apply_updates(params, updates)
    ...   return params, opt_state, jax.lax.pmean(loss, "data")
    >>> step = jax.jit(jaxcomp.steps.shard_train_step(
    ...     step_fn, mesh=mesh, state_specs=state.specs, batch_spec=P("data")))
    >>> n = 4 * jax.device_count()
    >>> batch = jax.device_put((jnp.ones((n, 4)), jnp.ones((n,))),
    ...                        NamedSharding(mesh, P("data")))
    >>> params, opt_state, loss = step(state.params, state.opt_state, batch)
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
  :func:`jaxcomp.make_train_step` jits it; :func:`jaxcomp.flax.train_step`
  runs an NNX model through it and :func:`jaxcomp.compressed_value_and_grad`
  takes its averaged gradient.

  ``loss_fn``, ``tx``, ``mesh``, ``layout``, ``axis_name``, ``batch_spec``,
  ``has_aux`` and ``per_device_loss`` are :func:`jaxcomp.make_train_step`'s;
  ``state_specs`` the state's partition specs.

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
