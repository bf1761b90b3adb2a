"""DiLoCo's layout of the one step body (:mod:`jaxcomp.steps`): one copy
of the parameters per device (or per island), a leading axis."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
from jax.sharding import PartitionSpec as P

from jaxcomp import _mesh
from jaxcomp import steps
from jaxcomp._mesh import AxisName
from jaxcomp.lowcomm._diloco import per_device_copies
from jaxcomp.lowcomm._diloco import snap_to_anchor
from jaxcomp.lowcomm._diloco import synced_params
from jaxcomp.placement import init_sharded


@dataclasses.dataclass(frozen=True)
class Islands(steps.Layout):
  """DiLoCo's layout: one copy of the parameters per device (or per island
  of devices), a leading axis sharded over the copies' axes; each copy
  takes its own inner steps between syncs (:func:`jaxcomp.diloco` in
  ``tx``). After each step, the leaves that synchronized are set to the
  new anchor exactly.

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

  Example:
    Two islands of 4 devices: exact averaging inside an island every step,
    DiLoCo's int8 exchange across islands every 20 steps:

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((2, jax.device_count() // 2), ("hosts", "data"))
    >>> inner = optax.chain(jaxcomp.compressed_mean("identity", "data"),
    ...                     optax.sgd(0.1))
    >>> tx = jaxcomp.diloco(inner, sync_every=20, compressor="int8_block",
    ...                     axis_name="hosts")
    >>> state = jaxcomp.init(tx, {"w": jnp.ones((3,))}, mesh,
    ...                      layout=jaxcomp.Islands(over="hosts"),
    ...                      axis_name=("hosts", "data"))
    >>> state.params["w"].shape  # one copy per island
    (2, 3)
  """

  over: AxisName | None = None
  inside: Any = None  # a jaxcomp.fsdp.FSDP layout

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
      copies, state, specs, inside = self.inside.place_copies(
          tx, params, mesh, axis_name, over)
      return copies, state, specs, dataclasses.replace(self, inside=inside)
    state, specs = init_sharded(tx, params, mesh, axis_name,
                                params_vary_over=over)
    return per_device_copies(params, mesh, over), state, specs, self

  def unresolved(self):
    if self.inside is None:
      return self
    return dataclasses.replace(self, inside=self.inside.unresolved())

  def model_params(self, params, opt_state):
    anchor = synced_params(opt_state)
    if self.inside is None:
      return anchor
    return self.inside.model_params(anchor, None)
