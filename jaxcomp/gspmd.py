"""Compression for ``jax.jit`` steps: :func:`compressed_value_and_grad`, the
averaged gradient of a loss through a compressed exchange, for training
steps that let XLA partition the batch (no hand-written per-device step),
with the parameters replicated, sharded by GSPMD over model axes, or held
as FSDP's flat shards. Its per-device gradient and exchange are the one
step body's (:func:`jaxcomp.steps.per_device_step`)."""

from __future__ import annotations

import dataclasses
import math
from typing import Any, NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P
import optax

from jaxcomp import _mesh
from jaxcomp import placement
from jaxcomp import transform as transform_lib
from jaxcomp._mesh import AxisName
from jaxcomp.fsdp import FSDP
from jaxcomp.placement import check_mesh_axes
from jaxcomp.placement import init_sharded
from jaxcomp.steps import DataParallel
from jaxcomp.steps import Layout
from jaxcomp.steps import per_device_step
from jaxcomp.steps import shard_train_step
from jaxcomp.steps import step_loss


def _leaf_specs_of(params, mesh):
  """Each parameter leaf's partition spec on ``mesh`` (one entry per
  dimension), read from its ``NamedSharding``, for the GSPMD route.

  Raises:
    ValueError: a leaf placed on another mesh, naming it.
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
    return P(*s, *([None] * (jnp.ndim(x) - len(s))))

  return jax.tree_util.tree_map_with_path(spec, params)


def _names(entry) -> tuple[str, ...]:
  """The mesh axes of one dimension's entry of a partition spec."""
  return () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)


def _entry(names: tuple[str, ...]):
  return None if not names else names[0] if len(names) == 1 else names


def _keep_axes(spec: P, keep) -> P:
  """``spec`` with only the mesh axes ``keep`` admits."""
  return P(*(_entry(tuple(a for a in _names(e) if keep(a))) for e in spec))


@dataclasses.dataclass(frozen=True)
class DataSharding:
  """How GSPMD shards one parameter leaf over data axes (FSDP / ZeRO-3 on
  a GSPMD mesh, e.g. MaxText's ``fsdp`` axis): its dimension ``dim`` is
  split into blocks over ``axes`` (in the spec's order, major first)."""

  dim: int
  axes: tuple[str, ...]


def _data_sharding(path, spec: P, data: tuple[str, ...]) -> DataSharding | None:
  """The data axes that shard a leaf, or None.

  Raises:
    ValueError: data axes over two dimensions, or a model axis ahead of a
      data axis in one dimension, naming the leaf and the fix. (JAX itself
      refuses a placement whose dimension does not split evenly.)
  """
  where = jax.tree_util.keystr(path) or "(root)"
  dims = [(d, _names(e)) for d, e in enumerate(spec)
          if set(_names(e)) & set(data)]
  if not dims:
    return None
  if len(dims) > 1:
    raise ValueError(
        f"parameter {where} is sharded over data axes in two dimensions "
        f"({spec}): the compressed reduce-scatter splits one dimension into "
        "blocks. Shard one dimension over the data axes (e.g. "
        "P('fsdp', 'tensor')) and the others over model axes")
  d, names = dims[0]
  axes = tuple(a for a in names if a in data)
  if names[:len(axes)] != axes:
    raise ValueError(
        f"parameter {where}'s dimension {d} is sharded over {names}: a model "
        "axis ahead of a data axis makes each device's data-axis block "
        "strided. Put the data axes first in that dimension, e.g. "
        f"P({_entry(axes + tuple(a for a in names if a not in axes))!r})")
  return DataSharding(d, axes)


class RoutedState(NamedTuple):
  """State of a transform routed by the parameters' data sharding
  (:class:`CompressedValueAndGrad` on parameters GSPMD shards over data
  axes)."""

  mean: Any  # the transform's state over the leaves no data axis shards,
  #            () where every leaf is sharded
  shards: tuple  # per group of leaves sharded over the same data axes: the
  #                state of their compressed reduce-scatter over those axes
  #                and of their shards' mean over the other data axes


def _block_view(x, dim: int) -> jax.Array:
  """``x`` with dimension ``dim`` first: its blocks along that dimension are
  then contiguous, FSDP's flat shards (:mod:`jaxcomp.fsdp`)."""
  return jnp.moveaxis(x, dim, 0)


def routed(transform, shardings, make_group):
  """``transform`` over the leaves that no data axis shards, and for each
  group of leaves sharded over the same data axes ``axes`` the
  transformation ``make_group(axes)``, which reduce-scatters their
  gradients into this device's blocks (``compressed_mean(...,
  output="shard")`` on their flat block view) and averages the blocks over
  the remaining data axes.

  Args:
    transform: the transformation of the unsharded leaves.
    shardings: per leaf (flattened), its :class:`DataSharding` or None.
    make_group: ``axes -> GradientTransformation`` of a group's flat
      blocks: init takes each parameter's block (flat), update the whole
      gradients (the sharded dimension first) and returns the blocks of
      the mean (flat).

  Returns:
    A ``GradientTransformation`` whose state is :class:`RoutedState`; its
    ``update`` needs ``params`` (this device's blocks).
  """
  groups: dict[tuple[str, ...], list[int]] = {}
  for i, s in enumerate(shardings):
    if s is not None:
      groups.setdefault(s.axes, []).append(i)
  plain = [i for i, s in enumerate(shardings) if s is None]
  group_txs = [make_group(axes) for axes in groups]

  def blocks(leaves, idx):
    return [_block_view(leaves[i], shardings[i].dim).reshape(-1) for i in idx]

  def init_fn(params):
    leaves = jax.tree.leaves(params)
    return RoutedState(
        mean=transform.init([leaves[i] for i in plain]) if plain else (),
        shards=tuple(tx.init(blocks(leaves, idx))
                     for tx, idx in zip(group_txs, groups.values())))

  def update_fn(updates, state, params=None):
    if params is None:
      raise ValueError("the routed transform's update needs params (this "
                       "device's blocks of the parameters)")
    grads, treedef = jax.tree.flatten(updates)
    leaves = treedef.flatten_up_to(params)
    out: list[Any] = [None] * len(grads)
    mean_state = state.mean
    if plain:
      mean, mean_state = transform.update(
          [grads[i] for i in plain], state.mean, [leaves[i] for i in plain])
      for i, m in zip(plain, mean):
        out[i] = m
    new_shards = []
    for tx, idx, st in zip(group_txs, groups.values(), state.shards):
      mean, st = tx.update([_block_view(grads[i], shardings[i].dim)
                            for i in idx], st, blocks(leaves, idx))
      for i, m in zip(idx, mean):
        block = _block_view(leaves[i], shardings[i].dim)
        out[i] = jnp.moveaxis(m.reshape(block.shape), 0, shardings[i].dim)
      new_shards.append(st)
    return treedef.unflatten(out), RoutedState(mean_state, tuple(new_shards))

  return optax.GradientTransformation(init_fn, update_fn)


_DATA_AXIS_IN_LOSS = ("Axes mentioned in manual_axis_type", "manual")


class CompressedValueAndGrad:
  """``jax.value_and_grad`` for ``jax.jit`` steps on sharded batches, with
  the gradient averaged by a compressed exchange: what
  :func:`jaxcomp.compressed_value_and_grad` returns (build it with that).

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

  **Parameters GSPMD shards over data axes too** (FSDP x tensor
  parallelism, MaxText's default mesh: ``("data", "fsdp", "tensor")``,
  weights ``P("fsdp", "tensor")``, the batch over ``("data", "fsdp")``,
  ``axis_name=("data", "fsdp")``). A leaf whose spec names data axes in one
  of its dimensions enters the per-device pass gathered over them by GSPMD
  (ZeRO-3's forward all-gather, its model-axis shards kept, as the plain
  step gathers it), and its per-device gradient, whole over those axes and this device's
  shard over the model axes, is reduce-scattered over them into this
  device's block through ``transform``'s own compressor
  (:func:`jaxcomp.transform.over_axes` with ``output="shard"``: the
  compressed reduce-scatter of FSDP's flat shards, here on the block with
  its sharded dimension first), then averaged over the other data axes by
  the same compressor (HSDP). ``transform`` must then be one
  :func:`jaxcomp.compressed_mean` over ``axis_name``. The parameters, the
  mean and an optimizer's state after it keep the leaves' shardings: no
  gathered copy is kept. Error feedback for such a leaf keeps one float32
  residual of its per-device gradient (whole over the sharding data axes)
  per device for the reduce-scatter, and one of its block for the mean
  (``CompressionStats.state_bytes`` counts both); an unbiased compressor
  without it (``error_feedback=False``) costs none. The state is a
  :class:`RoutedState`.

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
      ``init``, a parameter placed on another mesh, sharded over data axes
      in two dimensions or with a model axis ahead of a data axis in one
      (its blocks would be strided), or, for a leaf sharded over data
      axes, a ``transform`` that is not one ``compressed_mean`` or whose
      compressor cannot reduce-scatter (PowerSGD), naming it and the fix;
      in the call, a sharding constraint in ``loss_fn`` that names a data
      axis, saying what to write instead.

  Example:
    Called outside ``jax.jit`` too (each call then compiles); in a step,
    as :func:`compressed_value_and_grad` shows:

    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def loss_fn(params, batch):
    ...   return jnp.mean((batch @ params["w"]) ** 2)
    >>> grad_fn = jaxcomp.compressed_value_and_grad(
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
    # GSPMD: the mesh has axes the transform does not average over (or, as
    # init finds, a leaf is sharded over a data axis).
    self.gspmd = shapes is None and any(
        a not in self._data and mesh.shape[a] > 1 for a in mesh.axis_names)
    self.tx = transform  # routed by init where GSPMD shards leaves over data
    self.shardings: list[DataSharding | None] = []
    self.specs = None

  @property
  def params_spec(self):
    """The parameters' partition spec(s) under ``shard_map`` (the layout's;
    GSPMD: each leaf's, read by :meth:`init`)."""
    return self.layout.params_spec(self.axis_name)

  def init(self, params):
    """The transform's state for ``params``, placed on the mesh (per-device
    leaves with a leading device axis, as :func:`jaxcomp.init` places them).
    FSDP (``shapes`` given): ``params`` are the flat shards of
    :func:`jaxcomp.fsdp.shard_params`. GSPMD: ``params`` carry their
    ``NamedSharding`` s, which the step keeps.

    Raises:
      ValueError: with ``shapes``, no ``compressed_mean(...,
        output="shard")`` over ``shard_axis`` in the transform; without,
        a parameter or a transform the GSPMD route cannot take (see the
        class).
    """
    placement.check_array_leaves(params)
    self._check_transform_axes(params)
    grads = self.shapes
    if self.shapes is None:
      specs = _leaf_specs_of(params, self.mesh)
      self.shardings = [
          _data_sharding(path, spec, self._data)
          for (path, _), spec in zip(
              jax.tree_util.tree_flatten_with_path(params)[0],
              jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P)))]
      if self.gspmd or any(self.shardings):
        # The layout of the leaves as GSPMD shards them.
        self.gspmd, self.layout = True, DataParallel(specs)
      if any(self.shardings):
        self.tx = routed(self.transform, self.shardings, self._group)
        grads = jax.tree.map(self._local_grad, params, specs,
                             is_leaf=lambda x: isinstance(x, P))
    if isinstance(self.layout, FSDP):
      self.layout.check_transform(self.transform, params, self.mesh,
                                  self.axis_name)
    state, self.specs = init_sharded(self.tx, params, self.mesh,
                                     self.axis_name,
                                     params_spec=self.params_spec, grads=grads)
    return state

  def _check_transform_axes(self, params):
    """Raises ValueError unless the transform's compressed means average
    over this route's data axes, together and no others, naming both (the
    mean would otherwise differ between the devices of a data axis, which
    ``jax.shard_map`` reports as an output that requires replication)."""
    shapes = placement.init_shapes(self.transform, params, self.mesh,
                                   params_spec=self.params_spec)
    means = {path: tuple(_mesh.axes(c["axis_name"])) for path, c in
             transform_lib.transform_configs(shapes).items()}
    covered = {a for axes in means.values() for a in axes}
    if means and (covered != set(self._data)):
      raise ValueError(
          f"compressed_value_and_grad(axis_name={self.axis_name!r}) takes "
          f"each device's gradient over the data axes {self._data!r}, but "
          f"the transform's compressed_mean averages over "
          f"{sorted(covered)!r} ({means}): pass the same axes to both, e.g. "
          f"compressed_value_and_grad(..., axis_name={tuple(sorted(covered))!r})"
          f" or compressed_mean(..., axis_name={self.axis_name!r})")

  def _group(self, axes: tuple[str, ...]):
    """The transformation of the leaves GSPMD shards over the data axes
    ``axes``: ``transform`` over ``axes`` as a reduce-scatter into each
    device's blocks, then over the other data axes as a mean of the
    blocks (HSDP: the blocks' exchange across the replicas)."""
    # The other data axes (one of size 1 too: its mean types the blocks
    # as the same on each of its devices, which the step's out_specs need).
    rest = tuple(a for a in self._data if a not in axes)
    try:
      scatter = transform_lib.over_axes(self.transform, axes, output="shard")
      mean = transform_lib.over_axes(self.transform, rest) if rest else None
    except ValueError as e:
      raise ValueError(
          f"parameters sharded over the data axes {axes} have their gradient "
          "reduce-scattered over them by the transform's own compressor, so "
          "transform must be one jaxcomp.compressed_mean over axis_name whose "
          f"compressor can reduce-scatter: {e}") from e
    return optax.chain(scatter, mean) if mean is not None else scatter

  def _local_grad(self, x, spec) -> jax.ShapeDtypeStruct:
    """One device's gradient of leaf ``x``: whole over the data axes, its
    own shard over the model axes."""
    shape = [n // math.prod(self.mesh.shape[a] for a in _names(e)
                            if a not in self._data)
             for n, e in zip(jnp.shape(x), spec)]
    return jax.ShapeDtypeStruct(tuple(shape), jnp.result_type(x))

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
        self.loss_fn, self.tx, mesh=self.mesh, state_specs=self.specs,
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
    is_spec = lambda x: isinstance(x, P)
    def per_device(params, batch):
      # The parameters come in whole over the data axes (GSPMD gathers a
      # leaf it shards over them, ZeRO-3's forward all-gather, keeping its
      # model-axis shards), so the gradient is this device's own, whole over
      # the data axes (of the blocks, JAX would reduce-scatter it).
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
      mean, state = self.tx.update(grads, state, params)
      return mean, state, ()

    stacked = jax.tree.map(
        lambda s: P(data_spec, *_keep_axes(s, lambda a: a not in data)),
        self.params_spec, is_leaf=is_spec)
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
  """The averaged gradient of ``loss_fn`` through
  ``transform``'s compressed exchange, for ``jax.jit`` steps (parameters
  replicated, GSPMD-sharded over model axes, or FSDP flat shards): the one
  way in for a ``jax.jit`` step. Returns a :class:`CompressedValueAndGrad`,
  whose docstring holds the arguments, the routes and the errors raised.

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

