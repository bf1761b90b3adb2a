"""The one way in for a ``jax.shard_map`` train step: :func:`jaxcomp.init` places the
parameters and the optimizer state for a layout, :func:`jaxcomp.make_train_step`
builds the step, and :class:`jaxcomp.TrainState` is what passes between them.

Every layout of :mod:`jaxcomp.layouts` goes through the same two calls::

  state = jaxcomp.init(tx, params, mesh, layout=jaxcomp.FSDP())
  train_step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh,
                                       layout=jaxcomp.FSDP())
  state, loss = train_step(state, batch)

The step is :func:`jaxcomp.steps.per_device_step`'s body, the one step of
jaxcomp, jitted with the state donated.
"""

from __future__ import annotations

import dataclasses
from typing import Any
from collections.abc import Callable

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp import steps
from jaxcomp._mesh import AxisName
from jaxcomp.lowcomm import Islands
from jaxcomp.lowcomm import holds_diloco
from jaxcomp.placement import check_mesh_axes
from jaxcomp.steps import DataParallel
from jaxcomp.steps import Layout


class _Placement:
  """What a step needs to know about a :class:`jaxcomp.TrainState` besides its
  arrays: the mesh, the data axes, the layout as :func:`jaxcomp.init` resolved it
  and the state's partition specs. Static pytree data: equal placements
  reuse one compiled step."""

  __slots__ = ("mesh", "axis_name", "layout", "specs", "_key")

  def __init__(self, mesh, axis_name, layout: Layout, specs):
    self.mesh, self.axis_name = mesh, axis_name
    self.layout, self.specs = layout, specs
    leaves, treedef = jax.tree.flatten(
        specs, is_leaf=lambda x: isinstance(x, P) or x is None)
    self._key = (mesh, axis_name, treedef, tuple(leaves))

  def __eq__(self, other):
    return (isinstance(other, _Placement) and self._key == other._key
            and self.layout == other.layout)

  def __hash__(self):
    return hash(self._key)

  def __repr__(self):
    return (f"placement(axis_name={self.axis_name!r}, "
            f"layout={type(self.layout).__name__})")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
  """The parameters and the optimizer state of a ``shard_map`` train step,
  placed on the mesh as their layout holds them (:func:`jaxcomp.init` makes it,
  the step of :func:`jaxcomp.make_train_step` takes and returns it).

  A pytree: ``params`` and ``opt_state`` are its children (jit, donate,
  ``jax.tree.map`` and Orbax see them); where they live (mesh, axes,
  layout, the state's partition specs) is static data.

  Attributes:
    params: the parameters as the layout holds them: replicated (or placed
      by :class:`jaxcomp.DataParallel`'s ``spec``); FSDP's flat shards,
      each leaf ``(p * c,)`` sharded ``P(shard_axis)``; DiLoCo's copies,
      each leaf with a leading axis of one copy per device or island.
    opt_state: ``tx``'s state, its per-device leaves with a leading device
      axis (:func:`jaxcomp.get_stats` reads it).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("int8_block", "data"),
    ...                  optax.sgd(0.1))
    >>> state = jaxcomp.init(tx, {"w": jnp.ones((3, 4))}, mesh)
    >>> jax.tree.map(jnp.shape, state.params)
    {'w': (3, 4)}
    >>> type(state.layout).__name__, state.model_params() is state.params
    ('DataParallel', True)
  """

  params: Any
  opt_state: Any
  placement: _Placement = dataclasses.field(metadata=dict(static=True))

  @property
  def layout(self) -> Layout:
    """The layout as :func:`jaxcomp.init` resolved it (FSDP's shapes filled in)."""
    return self.placement.layout

  @property
  def specs(self):
    """The partition specs of ``opt_state`` under ``jax.shard_map``."""
    return self.placement.specs

  @property
  def mesh(self):
    """The mesh the state lives on."""
    return self.placement.mesh

  def model_params(self):
    """The whole parameters a model is evaluated with: the parameters
    (replicated); FSDP's shards gathered into whole leaves
    (:func:`jaxcomp.fsdp.unshard_params`); DiLoCo's synchronized anchor
    (:func:`jaxcomp.lowcomm.synced_params`, FSDP's islands made whole)."""
    return self.layout.model_params(self.params, self.opt_state)


def init(tx, params, mesh, *, layout: Layout = DataParallel(),
         axis_name: AxisName = "data") -> TrainState:
  """Places ``params`` on ``mesh`` as ``layout`` holds them and initialises
  ``tx``'s state there, under ``jax.shard_map`` (a jaxcomp transform's
  state is per device: error-feedback residuals, one per device).

  Args:
    tx: an Optax ``GradientTransformation`` holding jaxcomp transforms over
      ``axis_name`` (:func:`jaxcomp.compressed_mean`, :func:`jaxcomp.diloco`).
    params: the whole parameters, a pytree of arrays, the same on every
      process.
    mesh: a ``jax.sharding.Mesh`` with ``axis_name``.
    layout: where the parameters live (:mod:`jaxcomp.layouts`):
      :class:`jaxcomp.DataParallel` (replicated, the default),
      :class:`jaxcomp.FSDP` (flat shards, ZeRO-3; HSDP with ``shard_axis``)
      or :class:`jaxcomp.Islands` (DiLoCo: a copy per device or island).
    axis_name: the data-parallel axis, or a tuple of axes (HSDP's
      ``("hosts", "devices")``).

  Returns:
    A :class:`jaxcomp.TrainState`: the placed parameters and the state, with what
    :func:`jaxcomp.make_train_step`'s step needs to run them.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; a non-array
      leaf in ``params``; what the layout refuses, naming the fix (FSDP
      without a reduce-scattering transform in ``tx``, DiLoCo's
      ``Islands`` without a :func:`jaxcomp.diloco` in ``tx``, a
      :func:`jaxcomp.diloco` in ``tx`` with another layout).
    jaxcomp.distributed.AgreementError: in a multi-process job, processes
      started with another configuration, model or mesh.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
    ...                  optax.sgd(0.1))
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((4,))}, mesh)
    >>> state.params["w"].sharding.spec  # replicated
    P()
    >>> state.specs[0].feedback  # the residual: one per device
    ((P('data',),),)
  """
  if not isinstance(layout, Layout):
    raise TypeError(
        f"layout must be a jaxcomp layout (jaxcomp.DataParallel(), "
        f"jaxcomp.FSDP(), jaxcomp.Islands()), got {layout!r}")
  check_mesh_axes(mesh, axis_name)
  placed, opt_state, specs, resolved = layout.place(tx, params, mesh,
                                                    axis_name)
  _check_diloco(opt_state, resolved)
  return TrainState(placed, opt_state,
                    _Placement(mesh, axis_name, resolved, specs))


def _check_diloco(opt_state, layout: Layout) -> None:
  """Refuses DiLoCo without its layout, and its layout without DiLoCo."""
  if holds_diloco(opt_state) and not isinstance(layout, Islands):
    raise ValueError(
        "tx holds jaxcomp.diloco (or jaxcomp.zero_one_adam), whose local "
        "steps need each device's (or "
        "island's) own copy of the parameters: pass layout=jaxcomp.Islands() "
        "(or Islands(over=<the islands' axis>)) to jaxcomp.init and "
        "jaxcomp.make_train_step")
  if isinstance(layout, Islands) and not holds_diloco(opt_state):
    raise ValueError(
        "layout=jaxcomp.Islands() keeps a copy of the parameters per device "
        "or island, which only jaxcomp.diloco in tx synchronizes (or "
        "jaxcomp.zero_one_adam, between its local steps): wrap the "
        "inner optimizer in jaxcomp.diloco(...), or use "
        "layout=jaxcomp.DataParallel() for a step that averages every step")


def _check_same(state: TrainState, mesh, layout: Layout | None,
                axis_name: AxisName) -> None:
  """Refuses a state that :func:`jaxcomp.init` placed otherwise than this step
  runs it, naming the difference."""
  if not isinstance(state, TrainState):
    raise TypeError(
        "the step takes the TrainState that jaxcomp.init returned, "
        f"got {type(state).__name__}: call state = jaxcomp.init(tx, params, "
        "mesh, layout=...) and step(state, batch)")
  placed = state.placement
  if placed.mesh != mesh:
    raise ValueError("the state was placed by jaxcomp.init on another mesh "
                     "than make_train_step's mesh: pass the same mesh to both")
  if placed.axis_name != axis_name:
    raise ValueError(
        f"the state was placed by jaxcomp.init with axis_name="
        f"{placed.axis_name!r}, the step runs axis_name={axis_name!r}: "
        "pass the same axis_name to both")
  if layout is not None and layout.unresolved() != placed.layout.unresolved():
    raise ValueError(
        f"the state was placed by jaxcomp.init with layout="
        f"{placed.layout.unresolved()!r}, the step runs layout={layout!r}: "
        "pass the same layout to both")


def make_train_step(loss_fn: Callable, tx, *, mesh,
                    layout: Layout | None = None,
                    axis_name: AxisName = "data", batch_spec: Any = None,
                    has_aux: bool = False, donate: bool = True,
                    per_device_loss: bool = False) -> Callable:
  """The data-parallel train step of every layout, compiled: per device,
  its own gradient, ``tx``'s compressed update, the parameters updated,
  the loss averaged.

  Per device, under ``jax.shard_map`` over ``mesh``::

    params = layout's view of this device's parameters (FSDP: gathered)
    loss, grads = this device's value_and_grad(loss_fn)(params, batch)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    return params, opt_state, lax.pmean(loss, axis_name)

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` on the whole parameters (a
      float32 scalar, this device's mean over its share of the batch), or
      ``(loss, aux)`` with ``has_aux``.
    tx: the optimizer :func:`jaxcomp.init` was given.
    mesh: the device mesh :func:`jaxcomp.init` was given.
    layout: the layout :func:`jaxcomp.init` was given; default: whatever it was
      (the state carries it). Given, it must be the same.
    axis_name: the data-parallel axis (or tuple of axes), as for
      :func:`jaxcomp.init`.
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``
      (every leaf split over the devices along its first dimension).
    has_aux: ``loss_fn`` returns ``(loss, aux)``; ``aux`` is then averaged
      over ``axis_name`` too (every leaf a float array).
    donate: donate the state's buffers to the step.
    per_device_loss: return each device's own loss (and aux), stacked on a
      leading device axis, instead of their mean: the step then runs no
      collective besides ``tx``'s (DiLoCo between syncs runs none at all).

  Returns:
    ``step(state, batch) -> (state, loss)`` (or ``(state, (loss, aux))``),
    jitted, on the :class:`jaxcomp.TrainState` of :func:`jaxcomp.init`; ``batch`` placed
    on ``mesh`` with ``batch_spec`` (``jax.device_put(batch,
    NamedSharding(mesh, P("data")))``).

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; at the call, a
      state that :func:`jaxcomp.init` placed on another mesh, axes or layout.
    TypeError: at the call, a state that is not a :class:`jaxcomp.TrainState`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def loss_fn(params, batch):
    ...   x, y = batch
    ...   return jnp.mean((x @ params["w"] - y) ** 2)
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.5),
    ...                  optax.sgd(0.1))
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((4,))}, mesh)
    >>> step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh)
    >>> n = 4 * jax.device_count()
    >>> batch = jax.device_put((jnp.ones((n, 4)), jnp.ones((n,))),
    ...                        NamedSharding(mesh, P("data")))
    >>> state, loss = step(state, batch)
    >>> float(loss)
    1.0
    >>> state.params["w"]  # top-k sent half of the gradient, the rest is residual
    Array([0.2, 0.2, 0. , 0. ], dtype=float32)
  """
  check_mesh_axes(mesh, axis_name)
  if layout is not None and not isinstance(layout, Layout):
    raise TypeError(
        f"layout must be a jaxcomp layout (jaxcomp.DataParallel(), "
        f"jaxcomp.FSDP(), jaxcomp.Islands()), got {layout!r}")

  def step(state: TrainState, batch):
    _check_same(state, mesh, layout, axis_name)
    body = steps.per_device_step(
        loss_fn, tx, mesh=mesh, state_specs=state.specs,
        layout=state.layout, axis_name=axis_name, batch_spec=batch_spec,
        has_aux=has_aux, per_device_loss=per_device_loss)
    params, opt_state, out = body(state.params, state.opt_state, batch)
    return dataclasses.replace(state, params=params, opt_state=opt_state), out

  return jax.jit(step, donate_argnums=(0,) if donate else ())
