"""DiLoCo's train steps: per-device parameters placed on the mesh, the
compiled step, and the step for a user's own ``jax.jit`` step; each the
:class:`PerDevice` layout of the one step family."""

from __future__ import annotations

from typing import Any
from collections.abc import Callable

from jaxcomp import steps
from jaxcomp._mesh import AxisName
from jaxcomp.lowcomm._diloco import holds_diloco
from jaxcomp.lowcomm._layout import PerDevice


def init(tx, params, mesh, axis_name: AxisName = "data", *,
         copies_over: AxisName | None = None):
  """Initialises a state holding a :func:`diloco` transform and places one
  copy of ``params`` per device (or per island).

  Args:
    tx: the optimizer holding one :func:`diloco`.
    params: the parameters (the same on every process).
    mesh: the device mesh.
    axis_name: the step's data axes (or tuple of axes).
    copies_over: the axes holding separate copies: ``None`` (default)
      ``axis_name``, one copy per device. Islands: the outer axis of a
      ``("hosts", "data")`` mesh, with ``tx = jaxcomp.diloco(optax.chain(
      jaxcomp.compressed_mean("identity", "data"), inner), ...,
      axis_name="hosts")``: exact data parallelism inside each island,
      DiLoCo's (compressed) exchange across islands. Pass the same to
      :func:`make_train_step`.

  Returns:
    ``(local_params, opt_state, specs)``: the parameters with a leading
    axis of one copy per device (or island) sharded ``P(copies_over)``
    (they differ between syncs), and the state and specs as
    :func:`jaxcomp.init_sharded` returns them.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; ``copies_over``
      is not among ``axis_name``'s axes; with ``copies_over``, a ``tx``
      whose state varies over the island's other axes (its gradients not
      averaged inside the island first).
  """
  return steps.init(tx, params, mesh, axis_name,
                    layout=PerDevice(copies_over))


def make_train_step(loss_fn: Callable, tx, *, mesh, state_specs,
                    axis_name: AxisName = "data", batch_spec: Any = None,
                    has_aux: bool = False, donate: bool = True,
                    per_device_loss: bool = False,
                    copies_over: AxisName | None = None) -> Callable:
  """The DiLoCo train step, compiled: per device, its own gradient of its
  own parameters, ``tx``'s update (a sync every ``sync_every`` steps), the
  loss averaged.

  ``per_device_loss=True`` returns each device's own loss (shape ``(p,)``)
  instead of averaging it: the steps between syncs then run no collective
  at all, not even the loss's scalar all-reduce, so no device waits for
  another between syncs (what a run over slow or uneven links wants).

  ``copies_over``: as :func:`init` placed the copies (islands).

  Returns:
    ``step(local_params, opt_state, batch) -> (local_params, opt_state,
    loss)`` on the per-device parameters of :func:`init`.
  """
  return steps.make_train_step(
      loss_fn, tx, mesh=mesh, state_specs=state_specs, axis_name=axis_name,
      batch_spec=batch_spec, has_aux=has_aux, donate=donate,
      per_device_loss=per_device_loss, layout=PerDevice(copies_over))


class LocalStep:
  """DiLoCo for ``jax.jit`` steps: the per-device step as a function of
  global arrays, to call inside your own jitted step (the counterpart of
  :func:`jaxcomp.compressed_value_and_grad`, whose averaged gradient DiLoCo
  has none of: each device steps on its own gradient)::

    local_step = jaxcomp.lowcomm.local_step(loss_fn, tx, mesh)
    local, opt_state = local_step.init(params)

    @jax.jit
    def train_step(local, opt_state, batch):
      local, opt_state, loss = local_step(local, opt_state, batch)
      shared = jaxcomp.lowcomm.synced_params(opt_state)
      return local, opt_state, loss, ema_update(shared)   # your own code

  ``local`` holds one copy of the parameters per device (a leading device
  axis sharded ``P(axis_name)``); :func:`synced_params` reads the
  synchronized ones (replicated) anywhere in the step. Calling it runs
  exactly what :func:`make_train_step` compiles.

  Args:
    loss_fn: ``loss_fn(params, batch) -> loss`` (this device's mean over
      its share of the batch), or ``(loss, aux)`` with ``has_aux``.
    tx: the optimizer holding one :func:`diloco` over ``axis_name``.
    mesh: the device mesh.
    axis_name: the data-parallel axis (or tuple of axes).
    batch_spec: partition spec(s) of the batch; default ``P(axis_name)``.
    has_aux: whether ``loss_fn`` returns ``(loss, aux)``.
    per_device_loss: return each device's own loss (shape ``(p,)``; no
      collective between syncs) instead of their mean.
    copies_over: the axes holding separate copies, default ``axis_name``
      (one per device); islands: the outer axis (see :func:`init`), ``local``
      then holds one copy per island, sharded ``P(copies_over)``.

  Raises:
    ValueError: ``axis_name`` is not an axis of ``mesh``; from ``init``,
      ``tx`` holds no :func:`diloco`.
  """

  def __init__(self, loss_fn: Callable, tx, mesh, *,
               axis_name: AxisName = "data", batch_spec: Any = None,
               has_aux: bool = False, per_device_loss: bool = False,
               copies_over: AxisName | None = None):
    steps.check_mesh_axes(mesh, axis_name)
    self.tx, self.mesh, self.axis_name = tx, mesh, axis_name
    self.layout = PerDevice(copies_over)
    self._kwargs = dict(loss_fn=loss_fn, tx=tx, mesh=mesh, axis_name=axis_name,
                        batch_spec=batch_spec, has_aux=has_aux,
                        per_device_loss=per_device_loss)
    self.specs = None
    self._step = None

  def init(self, params):
    """``(local_params, opt_state)`` for ``params``, placed on the mesh (see
    :func:`init`); keeps the state's partition specs for the step."""
    local, opt_state, self.specs = init(self.tx, params, self.mesh,
                                        self.axis_name,
                                        copies_over=self.layout.over)
    if not holds_diloco(opt_state):
      raise ValueError("jaxcomp.lowcomm.local_step needs a tx holding "
                       "jaxcomp.diloco(...); for a compressed data-parallel "
                       "step use jaxcomp.compressed_value_and_grad")
    self._step = steps.per_device_step(state_specs=self.specs,
                                       layout=self.layout, **self._kwargs)
    return local, opt_state

  def __call__(self, local_params, opt_state, batch):
    """``(local_params, opt_state, loss)`` after one step (a sync every
    ``sync_every`` steps)."""
    if self._step is None:
      raise ValueError("call init(params) first: it places the state on the "
                       "mesh and derives its partition specs")
    return self._step(local_params, opt_state, batch)


def local_step(loss_fn: Callable, tx, mesh, *, axis_name: AxisName = "data",
               batch_spec: Any = None, has_aux: bool = False,
               per_device_loss: bool = False,
               copies_over: AxisName | None = None) -> LocalStep:
  """:class:`LocalStep`: the DiLoCo step for your own ``jax.jit`` step."""
  return LocalStep(loss_fn, tx, mesh, axis_name=axis_name,
                   batch_spec=batch_spec, has_aux=has_aux,
                   per_device_loss=per_device_loss, copies_over=copies_over)

