"""FSDP's layout of the one step family (:mod:`jaxcomp.steps`): the
parameters held as flat shards, gathered for the loss."""

from __future__ import annotations

import dataclasses
from typing import Any

from jax.sharding import PartitionSpec as P

from jaxcomp import _mesh
from jaxcomp import steps
from jaxcomp.fsdp import _shards
from jaxcomp._mesh import AxisName
from jaxcomp.placement import init_sharded


@dataclasses.dataclass(frozen=True)
class FSDP(steps.Layout):
  """Sharded data parallelism: each leaf held as a flat shard over
  ``shard_axis`` (:func:`jaxcomp.fsdp.shard_params`), gathered for the loss
  (compressed with ``param_compressor``: ZeRO++'s qwZ), its gradient
  reduce-scattered by a ``compressed_mean(..., output="shard")`` in ``tx``.

  Args:
    shapes: the whole parameters' shapes (``jax.ShapeDtypeStruct`` s):
      left None, :func:`jaxcomp.init` fills them in as it shards the
      parameters (the :class:`jaxcomp.TrainState`'s ``layout`` has them);
      given for :func:`jaxcomp.compressed_value_and_grad` on shards made
      by :func:`jaxcomp.fsdp.shard_params`.
    shard_axis: the axis the shards are over (default: the data axes; HSDP:
      the fast axis inside a host).
    param_compressor: compress the parameters' all-gather (a deterministic
      compressor, e.g. ``"int8_block"``), or None.

  Example:
    HSDP: sharded over ``devices`` inside a host, copies across ``hosts``,
    the gradient reduce-scattered exactly inside a host and its shards
    averaged across hosts in int8 blocks:

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((2, jax.device_count() // 2), ("hosts", "devices"))
    >>> tx = optax.chain(
    ...     jaxcomp.compressed_mean("identity", "devices", output="shard"),
    ...     jaxcomp.compressed_mean("int8_block", "hosts"), optax.sgd(0.1))
    >>> layout = jaxcomp.FSDP(shard_axis="devices")
    >>> state = jaxcomp.init(tx, {"w": jnp.ones((10, 4))}, mesh,
    ...                      layout=layout, axis_name=("hosts", "devices"))
    >>> state.params["w"].shape, state.params["w"].sharding.spec
    ((40,), P('devices',))
    >>> state.layout.shapes["w"].shape  # filled in by jaxcomp.init
    (10, 4)
  """

  shapes: Any = None
  shard_axis: AxisName | None = None
  param_compressor: Any = None

  def __post_init__(self):
    _shards.check_param_compressor(self.param_compressor)  # raises on a bad one

  def _axis(self, axis_name):
    return axis_name if self.shard_axis is None else self.shard_axis

  def params_spec(self, axis_name):
    return P(self._axis(axis_name))

  def value_and_grad(self, loss_fn, axis_name, *, has_aux=False):
    if self.shapes is None:
      raise ValueError("FSDP layout without shapes: place the parameters "
                       "with jaxcomp.init(tx, params, mesh, layout=FSDP()) "
                       "first, and step the state it returns")
    return _shards.value_and_grad(loss_fn, self.shapes, axis_name,
                                shard_axis=self._axis(axis_name),
                                param_compressor=self.param_compressor,
                                has_aux=has_aux)

  def place(self, tx, params, mesh, axis_name):
    shard_axis = self._axis(axis_name)
    shards, shapes = _shards.shard_params(params, mesh, shard_axis)
    _shards.check_transform(tx, shards, mesh, shard_axis)
    state, specs = init_sharded(tx, shards, mesh, axis_name,
                                params_spec=P(shard_axis), grads=shapes)
    return shards, state, specs, dataclasses.replace(self, shapes=shapes)

  def check_transform(self, tx, shards, mesh, axis_name):
    """Raises ValueError unless ``tx`` reduce-scatters over the shards'
    axis (a ``compressed_mean(..., output="shard")``), naming the fix."""
    _shards.check_transform(tx, shards, mesh, self._axis(axis_name))

  def unresolved(self):
    return dataclasses.replace(self, shapes=None)

  def model_params(self, params, opt_state):
    del opt_state
    return _shards.unshard_params(params, self.shapes)

  def place_copies(self, tx, params, mesh, axis_name, over):
    """``(copies, opt_state, specs, layout)`` for islands over ``over``
    with FSDP inside (:class:`jaxcomp.Islands` with ``inside=``): each
    island's copy of ``params`` as flat shards over ``shard_axis``, and
    this layout with its shapes.

    Raises:
      ValueError: ``shard_axis`` unset, overlapping ``over`` or not among
        ``axis_name``'s axes; ``tx`` not reduce-scattering over it.
    """
    shard_axis = self.shard_axis
    if shard_axis is None or set(_mesh.axes(shard_axis)) & set(
        _mesh.axes(over)) or not set(_mesh.axes(shard_axis)) <= set(
            _mesh.axes(axis_name)):
      raise ValueError(
          f"FSDP inside islands shards each island's copy over the "
          f"island's own devices: shard_axis={shard_axis!r} must be among "
          f"axis_name={axis_name!r} and apart from the islands' axes "
          f"{over!r}")
    shards, shapes = _shards.shard_params(params, mesh, shard_axis)
    _shards.check_transform(tx, shards, mesh, shard_axis, copies_over=over)
    state, specs = init_sharded(tx, shards, mesh, axis_name,
                                params_spec=P(shard_axis), grads=shapes,
                                params_vary_over=over)
    return (_shards.shard_copies(params, mesh, over, shard_axis), state,
            specs, dataclasses.replace(self, shapes=shapes))

  def gather(self, shards, axis_name):
    """Inside ``shard_map``: the whole parameters from this device's
    shards (what the loss sees)."""
    return _shards.gather_params(shards, self.shapes, self._axis(axis_name),
                               compressor=self.param_compressor)
