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
* :class:`FSDP`: flat shards over the data (or a host's) axis; a device's
  gradient is of the gathered parameters (:mod:`jaxcomp.fsdp`).
* :class:`PerDevice`: one copy per device, a leading device axis; a
  device's gradient is of its own copy (DiLoCo).

The entry points built on it (:func:`jaxcomp.make_train_step`,
:func:`jaxcomp.fsdp.make_train_step`, :func:`jaxcomp.lowcomm.make_train_step`,
:func:`jaxcomp.lowcomm.local_step`, :func:`jaxcomp.flax.train_step`,
:func:`jaxcomp.compressed_value_and_grad`) differ in their layout and in how
they hand the step to the user, not in the step. The ``jax.jit`` idiom,
:class:`CompressedValueAndGrad`, also takes parameters that GSPMD shards over model
axes, with the loss written for global arrays.
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

from jaxcomp import _fsdp
from jaxcomp import _mesh
from jaxcomp import placement
from jaxcomp._mesh import AxisName
from jaxcomp._diloco import per_device_copies
from jaxcomp._diloco import snap_to_anchor
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


@dataclasses.dataclass(frozen=True)
class FSDP(Layout):
  """Sharded data parallelism: each leaf held as a flat shard over
  ``shard_axis`` (:func:`jaxcomp.fsdp.shard_params`), gathered for the loss
  (compressed with ``param_compressor``: ZeRO++'s qwZ), its gradient
  reduce-scattered by a ``compressed_mean(..., output="shard")`` in ``tx``.

  Args:
    shapes: the whole parameters' shapes (``jax.ShapeDtypeStruct`` s, from
      :func:`jaxcomp.fsdp.shard_params`); None until :meth:`place` shards
      them.
    shard_axis: the axis the shards are over (default: the data axes; HSDP:
      the fast axis inside a host).
    param_compressor: compress the parameters' all-gather (a deterministic
      compressor, e.g. ``"int8_block"``), or None.
  """

  shapes: Any = None
  shard_axis: AxisName | None = None
  param_compressor: Any = None

  def __post_init__(self):
    _fsdp.check_param_compressor(self.param_compressor)  # raises on a bad one

  def _axis(self, axis_name):
    return axis_name if self.shard_axis is None else self.shard_axis

  def params_spec(self, axis_name):
    return P(self._axis(axis_name))

  def value_and_grad(self, loss_fn, axis_name, *, has_aux=False):
    if self.shapes is None:
      raise ValueError("FSDP layout without shapes: place the parameters "
                       "with jaxcomp.fsdp.init (or FSDP().place) first")
    return _fsdp.value_and_grad(loss_fn, self.shapes, axis_name,
                                shard_axis=self._axis(axis_name),
                                param_compressor=self.param_compressor,
                                has_aux=has_aux)

  def place(self, tx, params, mesh, axis_name):
    shard_axis = self._axis(axis_name)
    shards, shapes = _fsdp.shard_params(params, mesh, shard_axis)
    _fsdp.check_transform(tx, shards, mesh, shard_axis)
    state, specs = init_sharded(tx, shards, mesh, axis_name,
                                params_spec=P(shard_axis), grads=shapes)
    return shards, state, specs

  def gather(self, shards, axis_name):
    """Inside ``shard_map``: the whole parameters from this device's
    shards (what the loss sees)."""
    return _fsdp.gather_params(shards, self.shapes, self._axis(axis_name),
                               compressor=self.param_compressor)


@dataclasses.dataclass(frozen=True)
class PerDevice(Layout):
  """One copy of the parameters per device, a leading device axis sharded
  over the data axes: DiLoCo's inner steps, each device on its own copy
  between syncs (:func:`jaxcomp.diloco`). After each step, the leaves that
  synchronized are set to the new anchor exactly.

  Args:
    over: the axes holding separate copies; default (``None``) every data
      axis, one copy per device. Islands: an outer axis only (``"hosts"``
      on a ``("hosts", "data")`` mesh), each island's devices sharing one
      copy and averaging their gradients exactly inside ``tx`` (an inner
      ``compressed_mean("identity", "data")``), DiLoCo's exchange over
      ``over``.
    inside: islands with FSDP inside: each island's copy held as flat
      shards over ``inside.shard_axis`` (an :class:`FSDP` layout), gathered
      for the loss, the gradient reduce-scattered by an inner
      ``compressed_mean("identity", shard_axis, output="shard")``; DiLoCo's
      pseudo-gradient is then each device's shard, exchanged over ``over``
      with the devices holding the same shard in the other islands.
  """

  over: AxisName | None = None
  inside: FSDP | None = None

  def copies_axis(self, axis_name):
    return axis_name if self.over is None else self.over

  def params_spec(self, axis_name):
    if self.inside is None:
      return P(self.copies_axis(axis_name))
    return P(self.copies_axis(axis_name), self.inside._axis(axis_name))

  def value_and_grad(self, loss_fn, axis_name, *, has_aux=False):
    if self.inside is None:
      return super().value_and_grad(loss_fn, axis_name, has_aux=has_aux)
    return self.inside.value_and_grad(loss_fn, axis_name, has_aux=has_aux)

  def enter(self, params):
    return jax.tree.map(lambda x: x[0], params)

  def after_update(self, params, opt_state):
    return snap_to_anchor(params, opt_state)

  def leave(self, params):
    if self.over is not None and _mesh.types_track_devices(self.over):
      sharded = (set(_mesh.axes(self.inside.shard_axis))
                 if self.inside is not None and self.inside.shard_axis
                 is not None else set())
      inside = {a for x in jax.tree.leaves(params)
                for a in _mesh.varying_axes(x)} - set(_mesh.axes(self.over)) - sharded
      if inside:
        raise ValueError(
            f"islands: each copy over {self.over!r} is shared by the devices "
            f"of {tuple(sorted(inside))!r}, but the updated parameters differ "
            "between them: average the gradients inside the island first, "
            "with jaxcomp.compressed_mean('identity', "
            f"{tuple(sorted(inside))!r}) at the head of diloco's inner chain")
    return jax.tree.map(lambda x: x[None], params)

  def place(self, tx, params, mesh, axis_name):
    over = self.copies_axis(axis_name)
    if not set(_mesh.axes(over)) <= set(_mesh.axes(axis_name)):
      raise ValueError(f"the copies' axes over={over!r} must be among the "
                       f"step's axis_name={axis_name!r}")
    if self.inside is not None:
      shard_axis = self.inside.shard_axis
      if shard_axis is None or set(_mesh.axes(shard_axis)) & set(
          _mesh.axes(over)) or not set(_mesh.axes(shard_axis)) <= set(
              _mesh.axes(axis_name)):
        raise ValueError(
            f"FSDP inside islands shards each island's copy over the "
            f"island's own devices: shard_axis={shard_axis!r} must be among "
            f"axis_name={axis_name!r} and apart from the islands' axes "
            f"{over!r}")
      shards, shapes = _fsdp.shard_params(params, mesh, shard_axis)
      _fsdp.check_transform(tx, shards, mesh, shard_axis, copies_over=over)
      state, specs = init_sharded(tx, shards, mesh, axis_name,
                                  params_spec=P(shard_axis), grads=shapes,
                                  params_vary_over=over)
      return (_fsdp.shard_copies(params, mesh, over, shard_axis), state,
              specs)
    state, specs = init_sharded(tx, params, mesh, axis_name,
                                params_vary_over=over)
    return per_device_copies(params, mesh, over), state, specs


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

  Args:
    loss_fn, tx, mesh, state_specs, layout, axis_name, batch_spec, has_aux,
      per_device_loss: as :func:`make_train_step`.
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
      :class:`FSDP`, :class:`PerDevice`); default ``DataParallel(
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


# -- The jax.jit idiom ------------------------------------------------------


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
      _fsdp.check_transform(self.transform, params, self.mesh, self.shard_axis)
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
