"""Flax: NNX optimizers and Linen train states whose transform compresses.

``nnx.Optimizer(model, tx, wrt=nnx.Param)`` and Linen's
``TrainState.create(..., tx=tx)`` call ``tx.init`` eagerly, outside any
``shard_map``, where a jaxcomp transform has no device axis to create its
per-device state over (``NameError: axis_name 'data' is not bound``). The
helpers here initialise that state with :func:`jaxcomp.init`
instead and run the step per device under ``jax.shard_map``:

* NNX: :class:`Optimizer` (an ``nnx.Optimizer``) and :func:`train_step`,
  which runs ``loss_fn(model, batch)`` on each device's share of the batch
  with its own dropout keys, averages the BatchNorm statistics (and every
  other floating non-parameter state) over the devices after the step, as
  Flax's ImageNet example syncs ``batch_stats``, and updates the model and
  the optimizer in place. With ``Optimizer(..., layout=jaxcomp.FSDP())`` the model's
  parameters are flat shards (:mod:`jaxcomp.fsdp`), gathered inside the
  step; :func:`unsharded` gives a whole copy.
* NNX in a ``jax.jit`` step over GSPMD-sharded parameters (model axes,
  or FSDP x tensor parallelism as MaxText's NNX models shard them):
  :class:`ValueAndGrad`, the :func:`jaxcomp.compressed_value_and_grad`
  route for an ``nnx.Module``, beside a plain ``nnx.Optimizer``.
* Linen: :func:`create_train_state` (a ``flax.training.train_state.
  TrainState`` with the state placed per device) and
  :func:`train_state_step`, which wraps a per-device ``step(state, batch)``
  written with ``state.apply_gradients``.
"""

from __future__ import annotations

import inspect
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import NamedSharding, PartitionSpec as P
import optax

from flax import nnx
from flax.nnx.training import optimizer as nnx_optimizer
from flax.training import train_state as linen_train_state

from jaxcomp import _mesh
from jaxcomp import fsdp as fsdp_lib
from jaxcomp import gspmd
from jaxcomp import placement
from jaxcomp import steps
from jaxcomp import train
from jaxcomp.fsdp import FSDP
from jaxcomp.lowcomm import Islands
from jaxcomp.lowcomm import synced_params
from jaxcomp._mesh import AxisName


class Optimizer(nnx.Optimizer):
  """An ``nnx.Optimizer`` whose jaxcomp state is placed per device.

  Use it where ``nnx.Optimizer(model, tx, wrt=nnx.Param)`` would be, with
  the mesh, and step with :func:`train_step`.

  Args:
    model: the NNX model.
    tx: the optimizer, containing jaxcomp transforms over ``axis_name``.
    wrt: the variables to optimise (``nnx.Param``), as ``nnx.Optimizer``.
    mesh: the device mesh.
    axis_name: the data-parallel axis (or tuple of axes).
    layout: where the parameters live, as for :func:`jaxcomp.init`:
      :class:`jaxcomp.DataParallel` (replicated, the default);
      :class:`jaxcomp.FSDP` (FSDP / ZeRO-3, HSDP with ``shard_axis``, qwZ
      with ``param_compressor``): each ``wrt`` variable of ``model`` is
      replaced, in place, by its flat shard (as PyTorch FSDP swaps a
      module's parameters for flat shards); :func:`train_step` gathers
      them for the loss and ``tx`` (with a ``compressed_mean(...,
      output="shard")``) reduce-scatters the gradient, so parameters and
      optimizer state take ``1 / p`` of the memory per device; evaluate
      with :func:`unsharded` (a copy of the model with whole parameters);
      :class:`jaxcomp.Islands` with a :func:`jaxcomp.diloco` in ``tx``
      (``Islands(over="hosts")``: the outer axis of a ``("hosts",
      "data")`` mesh, with ``axis_name=("hosts", "data")`` and ``tx =
      jaxcomp.diloco(optax.chain(jaxcomp.compressed_mean("identity",
      "data"), inner), ..., axis_name="hosts")``: exact data parallelism
      inside each island, DiLoCo's exchange across islands).

  With a :func:`jaxcomp.diloco` in ``tx``, each device (or island) trains
  its own copy of the parameters between syncs: the optimizer keeps them in
  ``local`` (each leaf with a leading axis of copies, sharded
  ``P(over)``, saved with the optimizer's state), and after every
  step the model holds the synchronized parameters
  (:func:`jaxcomp.lowcomm.synced_params`: what evaluation uses; between
  syncs, those of the last sync).

  Raises:
    ValueError: what :func:`jaxcomp.init` raises (``axis_name`` not an
      axis of ``mesh``; FSDP without a ``compressed_mean(...,
      output="shard")`` over its ``shard_axis`` in ``tx``; a
      :func:`jaxcomp.diloco` in ``tx`` without the ``Islands`` layout, or
      that layout without one); ``Islands`` with FSDP inside, which the
      NNX optimizer does not hold.
  """

  def __init__(self, model, tx: optax.GradientTransformation, *, wrt, mesh,
               axis_name: AxisName = "data",
               layout: steps.Layout = steps.DataParallel()):
    params = nnx.as_pure(nnx.state(model, wrt))
    if isinstance(layout, Islands) and layout.inside is not None:
      raise ValueError("jaxcomp.flax.Optimizer holds DiLoCo islands of "
                       "replicated copies (layout=jaxcomp.Islands(over=...)); "
                       "islands with FSDP inside need jaxcomp.init and "
                       "jaxcomp.make_train_step")
    placed = train.init(tx, params, mesh, layout=layout, axis_name=axis_name)
    layout, state, specs = placed.layout, placed.opt_state, placed.specs
    copies = None  # DiLoCo: each device's (or island's) own parameters
    if isinstance(layout, FSDP):
      nnx.update(model, placed.params)
    elif isinstance(layout, Islands):
      copies = placed.params
    # nnx.Optimizer.__init__ with the state placed per device (its own
    # tx.init would run outside shard_map, where no device axis is bound).
    super().__init__(model, optax.GradientTransformation(
        lambda params: state, tx.update), wrt=wrt)
    self.tx = tx
    # DiLoCo: each device's own parameters, beside the model's synchronized
    # ones.
    self.local = nnx.data(None if copies is None
                          else nnx_optimizer.to_opt_state(copies))
    self.mesh = nnx.static(mesh)
    self.axis_name = nnx.static(axis_name)
    self.specs = nnx.static(_Static(specs))
    self._layout = nnx.static(_Static(layout))

  @property
  def layout(self) -> steps.Layout:
    """Where the parameters live (:mod:`jaxcomp.layouts`), as
    :func:`jaxcomp.init` resolved it: replicated, FSDP's flat shards, or
    DiLoCo's per-device copies."""
    return self._layout.tree

  @property
  def shapes(self):
    """The whole parameters' shapes under FSDP (None otherwise)."""
    return _Static(getattr(self.layout, "shapes", None))

  @property
  def params_spec(self):
    """The parameters' ``PartitionSpec``: ``P()`` replicated, FSDP's
    shard spec otherwise."""
    return (self.layout.params_spec(self.axis_name)
            if isinstance(self.layout, FSDP) else P())

  def update(self, model, grads, **kwargs):
    """``nnx.Optimizer.update`` inside a ``shard_map`` over the mesh with
    per-device gradients; outside one, jaxcomp's transforms have no device
    axis: step with :func:`train_step` instead.

    Raises:
      NameError: called where ``axis_name`` is not bound (a plain
        ``nnx.jit`` step), naming :func:`train_step`.
    """
    if not set(_mesh.axes(self.axis_name)) <= set(_mesh.bound_axes()):
      raise NameError(
          "jaxcomp.flax.Optimizer.update was called outside shard_map, where "
          f"its compressed exchange over {self.axis_name!r} has no devices. "
          "Step with jaxcomp.flax.train_step(loss_fn)(model, optimizer, "
          "batch): it takes each device's own gradient and runs the "
          "exchange under shard_map (gradients from nnx.grad of the whole "
          "batch are already averaged, and compressing them saves nothing)")
    return super().update(model, grads, **kwargs)


# The signature help(), IDEs and the API reference show: the constructor's,
# not the (*args, **kwargs) of nnx's object metaclass, which calls it.
_INIT_SIGNATURE = inspect.signature(Optimizer.__init__, eval_str=True)
Optimizer.__signature__ = _INIT_SIGNATURE.replace(
    parameters=list(_INIT_SIGNATURE.parameters.values())[1:])


def unsharded(model, optimizer: Optimizer):
  """A copy of ``model`` with whole parameters (replicated on the mesh),
  for evaluation or export, from an FSDP :class:`Optimizer`'s model (whose
  ``wrt`` variables hold flat shards); ``model`` itself is unchanged. A
  model that is not sharded is returned as a copy too."""
  copy = nnx.clone(model)
  shapes = optimizer.shapes.tree
  if shapes is not None:
    shards = nnx.as_pure(nnx.state(copy, optimizer.wrt))
    nnx.update(copy, fsdp_lib.unshard_params(shards, shapes))
  return copy


class _Static:
  """A pytree held as one static value (NNX metadata), compared by
  identity."""

  def __init__(self, tree):
    self.tree = tree


def _nnx_loss(loss_fn: Callable, graphdef, wrt, axis_name: AxisName):
  """``loss_fn(model, batch)`` as the step family's ``loss(params, inputs)``
  with model state (:func:`jaxcomp.steps.per_device_step`'s
  ``has_state``): ``inputs`` is ``(keys, rest, batch)``, the model is
  merged from ``params`` (the ``wrt`` variables), the random keys folded
  with the device index (dropout draws differently on each device) and
  ``rest``; it returns ``loss_fn``'s output and the model's other
  variables after the forward pass."""
  def loss(params, inputs):
    keys, rest, batch = inputs
    index = lax.axis_index(axis_name)
    keys = jax.tree.map(lambda k: jax.random.fold_in(k, index), keys)
    model = nnx.merge(graphdef, params, keys, rest)
    out = loss_fn(model, batch)
    *_, new_rest = nnx.split(model, wrt, nnx.RngKey, ...)
    return out, nnx.as_pure(new_rest)

  return loss


def train_step(loss_fn: Callable, *, has_aux: bool = False,
               batch_spec: Any = None,
               per_device_loss: bool = False) -> Callable:
  """The NNX data-parallel train step with compression, compiled.

  ``step(model, optimizer, batch)`` runs, under ``jax.shard_map`` over the
  optimizer's mesh, per device: ``loss_fn(model, batch)`` on this device's
  share of the batch, its gradient with respect to the optimizer's ``wrt``
  variables as this device's own (not summed by JAX), ``optimizer.tx``'s
  compressed update, and the parameter update. Dropout and other random
  streams draw different numbers on each device (their keys are folded with
  the device index for the step and kept as they were). BatchNorm
  statistics and every other floating variable that the forward pass
  changes are averaged over the devices afterwards. The model and the
  optimizer are updated in place, as ``nnx.Optimizer.update`` does.

  Args:
    loss_fn: ``loss_fn(model, batch) -> loss`` (a scalar), or ``(loss,
      aux)`` with ``has_aux``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``; ``aux`` is
      averaged over the devices.
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``.
    per_device_loss: return each device's own loss (and aux), with a
      leading device axis, instead of their mean: no collective for it
      (with :func:`jaxcomp.diloco` and a model without BatchNorm, the steps
      between syncs then run none at all).

  With a :func:`jaxcomp.diloco` in the optimizer's ``tx``, each device
  differentiates and updates its own parameters (``optimizer.local``), and
  the model is set to the synchronized parameters after the step.

  Returns:
    ``step(model, optimizer, batch) -> loss`` (or ``(loss, aux)``), the
    loss averaged over the devices. ``optimizer`` must be a
    :class:`Optimizer`; ``batch`` placed on its mesh with ``batch_spec``.
    ``step.lower(model, optimizer, batch)`` lowers it without running it.
    Assigning another transformation of the same state structure to
    ``optimizer.tx`` (the next stage of :func:`jaxcomp.sparsity_warmup`)
    compiles a step for it.

  Raises:
    TypeError: ``optimizer`` is a plain ``nnx.Optimizer``.
  """
  # nnx.jit carries the model and the optimizer in and out of the compiled
  # step (their Python walk is nnx.jit's own, so the step costs what a plain
  # nnx.jit step does); it compiles again when their structure changes,
  # e.g. when a warm-up stage assigns another optimizer.tx.
  @nnx.jit(donate_argnums=(0, 1))
  def compiled(model, optimizer, batch):
    graphdef, params, keys, rest = nnx.split(model, optimizer.wrt, nnx.RngKey,
                                             ...)
    axis, local = optimizer.axis_name, optimizer.local
    step = steps.per_device_step(
        _nnx_loss(loss_fn, graphdef, optimizer.wrt, axis), optimizer.tx,
        mesh=optimizer.mesh, state_specs=optimizer.specs.tree,
        layout=optimizer.layout, axis_name=axis,
        batch_spec=(P(), P(), P(axis) if batch_spec is None else batch_spec),
        has_aux=has_aux, per_device_loss=per_device_loss, has_state=True)
    # DiLoCo: the step runs on each device's own parameters; the model
    # holds the synchronized ones.
    params, opt_state, (out, rest) = step(
        nnx.as_pure(params if local is None else local),
        nnx.as_pure(optimizer.opt_state),
        (nnx.as_pure(keys), nnx.as_pure(rest), batch))
    if local is not None:
      nnx.update(optimizer.local, nnx.state(params))
      params = synced_params(opt_state)
    nnx.update(model, params, rest)
    nnx.update(optimizer.opt_state, nnx.state(opt_state))
    optimizer.step.set_value(optimizer.step[...] + 1)
    return out

  def check(optimizer):
    if not hasattr(optimizer, "specs"):
      raise TypeError(
          "jaxcomp.flax.train_step needs a jaxcomp.flax.Optimizer(model, tx, "
          "wrt=..., mesh=mesh, axis_name=...): an nnx.Optimizer cannot "
          "initialise a jaxcomp transform outside shard_map")

  def step(model, optimizer, batch):
    check(optimizer)
    try:
      return compiled(model, optimizer, batch)
    except ValueError as e:
      if "incompatible devices" not in str(e):
        raise
    # A variable placed off the mesh (a checkpoint restored onto one
    # device, say): the model's and the optimizer's state go onto the mesh,
    # then the step runs (nothing ran or was donated above).
    _place_on_mesh(model, optimizer)
    return compiled(model, optimizer, batch)

  def lower(model, optimizer, batch):
    """The compiled step's ``jax.stages.Lowered`` (for
    :func:`jaxcomp.collective_traffic`); runs nothing."""
    check(optimizer)
    return compiled.lower(model, optimizer, batch)

  step.lower = lower  # pyright: ignore[reportFunctionMemberAccess]
  return step


def _place_on_mesh(model, optimizer) -> None:
  """Puts the model's variables (the ``wrt`` ones with the optimizer's
  parameter spec, the others replicated) and the optimizer's step count on
  the optimizer's mesh, in place."""
  mesh = optimizer.mesh
  params, rest = nnx.split(model, optimizer.wrt, ...)[1:]
  nnx.update(model, _placed(nnx.as_pure(params),
                            NamedSharding(mesh, optimizer.params_spec)),
             _placed(nnx.as_pure(rest), NamedSharding(mesh, P())))
  optimizer.step.set_value(
      _placed(optimizer.step[...], NamedSharding(mesh, P())))


def _placed(tree, sharding):
  """``tree`` on ``sharding``: as it is when every leaf already is (the
  previous step's outputs; ``jax.device_put`` of a placed array still costs
  about 20 us a leaf), else ``jax.device_put``."""
  leaves = jax.tree.leaves(tree)
  if all(isinstance(x, jax.Array) and x.sharding == sharding for x in leaves):
    return tree
  return jax.device_put(tree, sharding)


def create_train_state(apply_fn: Callable, params, tx, *, mesh,
                       axis_name: AxisName = "data", state_class=None):
  """A Linen ``TrainState`` whose jaxcomp state is placed per device.

  ``TrainState.create(apply_fn=..., params=..., tx=tx)`` would call
  ``tx.init`` outside ``shard_map``; this initialises it with
  :func:`jaxcomp.placement.init_sharded`.

  Args:
    apply_fn: the model's ``apply``.
    params: the parameters.
    tx: the optimizer, containing jaxcomp transforms over ``axis_name``.
    mesh: the device mesh.
    axis_name: the data-parallel axis (or tuple of axes).
    state_class: a ``TrainState`` subclass (default
      ``flax.training.train_state.TrainState``); extra fields keep their
      defaults.

  Returns:
    ``(state, specs)``: the train state (parameters replicated on
    ``mesh``) and the partition specs of its ``opt_state`` for
    :func:`train_state_step`.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``.
  """
  if state_class is None:
    state_class = linen_train_state.TrainState
  opt_state, specs = placement.init_sharded(tx, params, mesh, axis_name)
  params = jax.device_put(params, NamedSharding(mesh, P()))
  state = state_class(step=jax.device_put(jnp.zeros((), jnp.int32),
                                          NamedSharding(mesh, P())),
                      apply_fn=apply_fn, params=params, tx=tx,
                      opt_state=opt_state)
  return state, specs


def train_state_step(step_fn: Callable, *, mesh, opt_specs,
                     batch_spec: Any = None, axis_name: AxisName = "data",
                     donate: bool = True) -> Callable:
  """Compiles a per-device Linen step ``step_fn(state, batch) -> (state,
  aux)`` under ``jax.shard_map``.

  ``step_fn`` is written per device as usual::

    def step_fn(state, batch):
      loss, grads = jaxcomp.per_device_value_and_grad(loss_fn, "data")(
          state.params, batch)
      return state.apply_gradients(grads=grads), lax.pmean(loss, "data")

  and sees ``state.opt_state`` without the device axis; ``aux`` must be
  identical on every device (a ``lax.pmean``).

  Args:
    step_fn: the per-device step.
    mesh: the device mesh.
    opt_specs: the specs :func:`create_train_state` returned.
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``.
    axis_name: the data-parallel axis (or tuple of axes).
    donate: donate the state's buffers to the step.

  Returns:
    ``step(state, batch) -> (state, aux)`` on global arrays, jitted.
  """
  bspec = P(axis_name) if batch_spec is None else batch_spec

  def body(rest, opt_state, batch):
    # The step family's body signature: the train state without its
    # optimizer state (replicated), the optimizer state (local view).
    state, aux = step_fn(rest.replace(opt_state=opt_state), batch)
    return state.replace(opt_state=None), state.opt_state, aux

  def run(state, batch):
    rest = state.replace(opt_state=None)
    rest, opt_state, aux = steps.shard_train_step(
        body, mesh=mesh, state_specs=opt_specs, batch_spec=bspec,
        params_spec=jax.tree.map(lambda _: P(), rest))(
            rest, state.opt_state, batch)
    return rest.replace(opt_state=opt_state), aux

  return jax.jit(run, donate_argnums=(0,) if donate else ())


class ValueAndGrad:
  """``nnx.value_and_grad`` whose gradient is a compressed mean over the
  data axes, for an NNX model whose parameters GSPMD shards: the
  :func:`jaxcomp.compressed_value_and_grad` route (model axes, or FSDP x
  tensor parallelism, MaxText's ``("data", "fsdp", "tensor")`` mesh with
  ``nnx.Param`` s annotated ``("fsdp", "tensor")``) on the model's ``wrt``
  variables. The model is split with ``nnx.split(model, wrt, ...)``; the
  loss runs on the model merged from them, each device on its share of the
  batch; the gradient is an ``nnx.State`` placed like the parameters, for
  a plain ``nnx.Optimizer``'s ``update(model, grads)``.

  The model's other variables are read, not updated, by this route:
  ``loss_fn`` may not change them (BatchNorm statistics in training mode,
  an ``nnx.Rngs`` stream drawn for dropout); use :class:`Optimizer` with
  :func:`train_step` for such models.

  Args:
    loss_fn: ``loss_fn(model, batch) -> loss`` (this device's mean over
      its share of the batch), or ``(loss, aux)`` with ``has_aux``.
    transform: one :func:`jaxcomp.compressed_mean` over ``axis_name`` (or
      a chain of them where no parameter is sharded over a data axis).
    mesh: the device mesh (``AxisType.Auto`` model axes).
    axis_name: the data-parallel axis or axes (FSDP x tensor parallelism:
      ``("data", "fsdp")``).
    wrt: the variables differentiated (default ``nnx.Param``).
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.

  Raises:
    ValueError: as :class:`jaxcomp.gspmd.CompressedValueAndGrad` (bad axes,
      parameters sharded over data axes in two dimensions, a transform
      that cannot reduce-scatter such a leaf); when traced, a ``loss_fn``
      that changes variables other than ``wrt``, naming them.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp, jaxcomp.flax
    >>> from flax import nnx
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> model = nnx.Linear(4, 1, use_bias=False, rngs=nnx.Rngs(0))
    >>> def loss_fn(model, batch):
    ...   return jnp.mean(model(batch) ** 2)
    >>> grad_fn = jaxcomp.flax.ValueAndGrad(
    ...     loss_fn, jaxcomp.compressed_mean("bf16", "data"), mesh)
    >>> comp_state = grad_fn.init(model)
    >>> optimizer = nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)
    >>> @nnx.jit
    ... def train_step(model, optimizer, comp_state, batch):
    ...   (loss, grads), comp_state = grad_fn(model, comp_state, batch)
    ...   optimizer.update(model, grads)
    ...   return loss, comp_state
    >>> batch = jax.device_put(jnp.ones((2 * jax.device_count(), 4)),
    ...                        NamedSharding(mesh, P("data")))
    >>> loss, comp_state = train_step(model, optimizer, comp_state, batch)
    >>> model.kernel[...].shape
    (4, 1)
  """

  def __init__(self, loss_fn: Callable, transform, mesh, *,
               axis_name: AxisName = "data", wrt: Any = nnx.Param,
               batch_spec: Any = None, has_aux: bool = False):
    self.loss_fn, self.wrt = loss_fn, wrt
    self._graphdef = None
    self.batch_spec = P(axis_name) if batch_spec is None else batch_spec
    self._functional = gspmd.CompressedValueAndGrad(
        self._loss, transform, mesh, axis_name=axis_name, has_aux=has_aux,
        batch_spec=self.batch_spec)

  def _loss(self, params, inputs):
    """The functional loss: the model merged from ``params`` and the other
    variables (which it may not change)."""
    rest, batch = inputs
    # Fresh variables at this trace level (those that came in belong to the
    # caller's, where NNX would refuse a change as a TraceContextError).
    rest = jax.tree.map(lambda x: x, rest)
    before = dict(jax.tree_util.tree_leaves_with_path(rest))
    graphdef = self._graphdef
    assert graphdef is not None, "set by __call__ before the loss is traced"
    model = nnx.merge(graphdef, params, rest)
    out = self.loss_fn(model, batch)
    _, _, after = nnx.split(model, self.wrt, ...)
    changed = [jax.tree_util.keystr(k) for k, v in
               jax.tree_util.tree_leaves_with_path(after)
               if before.get(k) is not v]
    if changed:
      raise ValueError(
          f"loss_fn changed the model's variables {changed[:4]} besides "
          f"wrt={self.wrt!r}: jaxcomp.flax.ValueAndGrad reads those, it does "
          "not update them (BatchNorm statistics, dropout's nnx.Rngs); train "
          "such a model with jaxcomp.flax.Optimizer and jaxcomp.flax."
          "train_step, or keep them out of the loss")
    return out

  def init(self, model):
    """The transform's state for the model's ``wrt`` variables (read with
    their ``NamedSharding`` s, which the step keeps); see
    :meth:`jaxcomp.gspmd.CompressedValueAndGrad.init`."""
    _, params, _ = nnx.split(model, self.wrt, ...)
    return self._functional.init(params)

  def __call__(self, model, state, batch):
    """``((loss, grads), state)``: the loss (and aux) averaged over the
    devices, the compressed mean of the per-device gradients as an
    ``nnx.State`` of the ``wrt`` variables, and the transform's new
    state."""
    graphdef, params, rest = nnx.split(model, self.wrt, ...)
    # The loss reads the graph when traced; the other variables go in
    # replicated over the data axes beside the batch.
    self._graphdef = graphdef
    self._functional.batch_spec = (jax.tree.map(lambda _: P(), rest),
                                   self.batch_spec)
    return self._functional(params, state, (rest, batch))

