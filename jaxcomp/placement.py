"""Placement under ``jax.shard_map``: per-device gradients and state.

Two traps that this module closes:

* Inside ``shard_map``, ``jax.grad`` with respect to *replicated* parameters
  returns a gradient that JAX has already summed over the axis (the transpose
  of the implicit broadcast is a psum), so compressing it saves nothing.
  :func:`per_device_grad` marks the parameters varying first.
* The optimizer state mixes per-device leaves (error-feedback residuals) and
  replicated ones (moments, counts, shared keys). :func:`init_sharded`
  derives each leaf's partition spec from its varying axes, and
  :func:`shard_train_step` wraps a step function with them.
"""

from __future__ import annotations

from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P
import optax

from jaxcomp import distributed
from jaxcomp import transform
from jaxcomp._mesh import AxisName
from jaxcomp._mesh import check_axis_name
from jaxcomp._mesh import check_bound
from jaxcomp._mesh import to_varying
from jaxcomp._mesh import varying_axes


def per_device_value_and_grad(fun: Callable, axis_name: AxisName, *,
                              has_aux: bool = False) -> Callable:
  """``jax.value_and_grad`` of ``fun`` w.r.t. its first argument, per device.

  Use inside ``shard_map`` with replicated parameters: the returned gradient
  is this device's own gradient (varying over ``axis_name``), not the sum over
  devices that plain ``jax.grad`` would give. Under ``pmap`` the parameters
  are already per device and nothing changes.

  Args:
    fun: ``fun(params, *args) -> loss`` (or ``(loss, aux)`` with ``has_aux``).
    axis_name: the data-parallel mesh axis (or a tuple of axes).
    has_aux: as in ``jax.value_and_grad``.

  Returns:
    ``f(params, *args) -> (value, grads)``; the value is per device too.
    An integer or boolean leaf of ``params`` (a step counter, a mask) gets
    a zero gradient of its own dtype, where ``jax.grad`` refuses it: leave
    it out of the exchange with ``compressed_mean(..., mask=...)``.

  Raises:
    NameError: ``f`` is called where ``axis_name`` is not bound (outside
      ``shard_map``/``pmap``), saying where to call it.

  Example:
    Each device's gradient of ``sum((x * w) ** 2)``, ``2 * x**2 * w`` for
    its own ``x``, where plain ``jax.grad`` gives every device their sum:

    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    >>> def loss_fn(w, x):  # x: this device's share of the batch
    ...   return jnp.sum((x * w) ** 2)
    >>> def per_device(w, x):
    ...   loss, g = jaxcomp.per_device_value_and_grad(loss_fn, "data")(w, x)
    ...   return loss[None], g[None]
    >>> losses, grads = jax.jit(jax.shard_map(
    ...     per_device, mesh=mesh, in_specs=(P(), P("data")),
    ...     out_specs=P("data")))(jnp.float32(1.0), x)
    >>> grads  # one per device
    Array([ 0.,  2.,  8., 18., 32., 50., 72., 98.], dtype=float32)
    >>> jax.jit(jax.shard_map(
    ...     lambda w, x: jax.grad(loss_fn)(w, x)[None], mesh=mesh,
    ...     in_specs=(P(), P("data")), out_specs=P("data")))(
    ...         jnp.float32(1.0), x)  # already summed: nothing to compress
    Array([280., 280., 280., 280., 280., 280., 280., 280.], dtype=float32)
  """
  vg = jax.value_and_grad(fun, has_aux=has_aux, allow_int=True)

  def wrapped(params, *args, **kwargs):
    check_bound(axis_name, "per_device_value_and_grad")
    params = to_varying(params, axis_name)
    value, grads = vg(params, *args, **kwargs)
    return value, jax.tree.map(_zero_for_float0, grads, params)

  return wrapped


def _zero_for_float0(g, p):
  """An integer or boolean parameter's gradient as zeros of its own dtype
  (``jax.grad`` gives ``float0``, which no optimizer can scale), so that
  ``compressed_mean(..., mask=...)`` leaves it out and its update is zero."""
  if jnp.result_type(g) == jax.dtypes.float0:
    return jnp.zeros_like(p)
  return g


def per_device_grad(fun: Callable, axis_name: AxisName, *,
                    has_aux: bool = False) -> Callable:
  """Like :func:`per_device_value_and_grad`, returning only the gradient
  (and aux with ``has_aux``).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> x = jax.device_put(jnp.arange(8.0), NamedSharding(mesh, P("data")))
    >>> grad_fn = jaxcomp.per_device_grad(lambda w, x: jnp.sum(x * w), "data")
    >>> jax.jit(jax.shard_map(
    ...     lambda w, x: grad_fn(w, x)[None], mesh=mesh,
    ...     in_specs=(P(), P("data")), out_specs=P("data")))(
    ...         jnp.float32(1.0), x)  # each device's own x
    Array([0., 1., 2., 3., 4., 5., 6., 7.], dtype=float32)
  """
  vg = per_device_value_and_grad(fun, axis_name, has_aux=has_aux)

  def wrapped(params, *args, **kwargs):
    (value, grads) = vg(params, *args, **kwargs)
    return (grads, value[1]) if has_aux else grads

  return wrapped


def check_array_leaves(params, what: str = "params") -> None:
  """Raises TypeError naming the first leaf of ``params`` that is not an
  array (an Equinox module's activation function, say), with how to pass
  the arrays alone.

  Raises:
    TypeError: a leaf that is not an array, a NumPy value or a Python
      number.
  """
  for path, x in jax.tree_util.tree_flatten_with_path(params)[0]:
    if isinstance(x, (jax.Array, np.ndarray, np.generic, int, float, complex,
                      jax.ShapeDtypeStruct)) or hasattr(x, "__jax_array__"):
      continue
    raise TypeError(
        f"{what}{jax.tree_util.keystr(path)} is a {type(x).__name__}, not an "
        "array: jaxcomp places and compresses arrays only. Pass the arrays "
        "and keep the rest aside, as Equinox does: params, static = "
        "eqx.partition(model, eqx.is_array), then eqx.combine(params, "
        "static) inside loss_fn")


def _spec_for(axes: frozenset[str], mesh) -> P:
  ordered = tuple(a for a in mesh.axis_names if a in axes)
  if not ordered:
    return P()
  return P(ordered[0] if len(ordered) == 1 else ordered)


def check_mesh_axes(mesh, axis_name) -> None:
  """Raises ValueError unless ``axis_name`` names axes of ``mesh``."""
  missing = [a for a in check_axis_name(axis_name)
             if a not in mesh.axis_names]
  if missing:
    raise ValueError(f"axis_name {missing} not in the mesh axes "
                     f"{mesh.axis_names}")


def _is_spec(x) -> bool:
  return isinstance(x, P)


def _spec_axes(spec: P) -> frozenset:
  """The mesh axes a partition spec shards over."""
  return frozenset(x for a in spec if a is not None
                   for x in ((a,) if isinstance(a, str) else a))


def _leaf_specs(spec, tree) -> list:
  """One partition spec per leaf of ``tree``: ``spec`` itself, or the leaves
  of a pytree of specs (a prefix of ``tree``'s structure)."""
  if _is_spec(spec):
    return [spec] * len(jax.tree.leaves(tree))
  return jax.tree.leaves(jax.tree.map(
      lambda s, sub: jax.tree.map(lambda _: s, sub), spec, tree,
      is_leaf=_is_spec), is_leaf=_is_spec)


def _refuse_per_device_combinators(state) -> None:
  """Raises ValueError where ``optax.apply_if_finite`` wraps a jaxcomp
  transform: it decides on each device's own gradient, so devices could
  disagree about running the exchange (JAX refuses to trace it, with a cond
  type error that does not say why)."""
  is_aif = lambda x: isinstance(x, optax.ApplyIfFiniteState)
  for x in jax.tree.leaves(state, is_leaf=is_aif):
    if not is_aif(x):
      continue
    has_mean = lambda y: isinstance(y, transform.CompressedMeanState)
    if any(has_mean(y) for y in jax.tree.leaves(x.inner_state, is_leaf=has_mean)):
      raise ValueError(
          "optax.apply_if_finite wraps a jaxcomp.compressed_mean: it checks each "
          "device's own gradient, so the devices could disagree about running "
          "the exchange; use jaxcomp.apply_if_finite(inner, axis_name, "
          "max_consecutive_errors), which decides on every device's gradient "
          "together (or compressed_mean's own nonfinite='skip', the default)")


class PlacementError(ValueError):
  """jaxcomp could not derive where an optimizer state leaf lives: ``tx.update``
  does not trace under ``jax.shard_map`` with per-device gradients and the
  state's types. The message names JAX's own error (chained as
  ``__cause__``) and the fix; the train step would fail the same way.

  Raised by :func:`jaxcomp.init`, :func:`init_sharded`,
  :func:`state_partition_specs` and everything that places a state
  (:class:`jaxcomp.flax.Optimizer`, :func:`jaxcomp.compressed_value_and_grad`).

  Example:
    A running sum of the gradient, replicated by ``init``, that one branch
    of a ``lax.cond`` makes per device:

    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> def init(params):
    ...   return jnp.zeros((), jnp.float32)
    >>> def update(grads, total, params=None):
    ...   total = jax.lax.cond(total >= 0,
    ...                        lambda: total + jnp.sum(grads["w"]),
    ...                        lambda: total)
    ...   return grads, total
    >>> tx = optax.chain(optax.GradientTransformation(init, update),
    ...                  jaxcomp.compressed_mean("topk", "data"))
    >>> jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros((4,))}, mesh, "data")
    Traceback (most recent call last):
    ...
    jaxcomp.placement.PlacementError: jaxcomp could not place the optimizer state: ...

    The fix the message names: ``init`` returns
    ``jaxcomp.placement.to_varying(jnp.zeros(()), "data")``, a sum per device.
  """


def _update_axes(update, args, in_axes, mesh) -> list[frozenset[str]]:
  """Mesh axes each leaf of the new state from ``update(*args)`` varies
  over, read from JAX's own types: ``update`` is traced (nothing runs) per
  device under ``jax.shard_map`` with ``check_vma=True``, each leaf of
  ``args`` (one device's shapes) typed varying over its ``in_axes``.

  Raises:
    PlacementError: ``update`` does not trace so (JAX's error chained).
    ValueError, NameError: what ``update`` itself raises so (a jaxcomp
      transform's refusal of its configuration), unchanged.
  """
  flat, tree = jax.tree.flatten(args)
  found = []

  def probe(*xs):
    xs = [to_varying(x, tuple(sorted(a))) if a else x
          for x, a in zip(xs, in_axes)]
    new_state = update(*jax.tree.unflatten(tree, xs))[1]
    found.append([varying_axes(x) for x in jax.tree.leaves(new_state)])
    return jnp.zeros((), jnp.float32)

  try:
    # Types only: the promotion rules the step runs under (a user's strict
    # ones, or optax's need of standard ones) change dtypes, not the axes.
    with jax.numpy_dtype_promotion("standard"), \
        jax.numpy_rank_promotion("allow"):
      jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=P(),
                                   out_specs=P()), *flat)
  except (ValueError, NameError):
    raise  # what the update refuses, in its own words (jaxcomp's are these)
  except Exception as e:  # pylint: disable=broad-except
    cause = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    raise PlacementError(
        "jaxcomp could not place the optimizer state: tx.update(grads, state, "
        f"params) does not trace per device under jax.shard_map ({cause}). The "
        "train step traces the same update and would fail alike. Make the "
        "update trace with per-device gradients (inside jax.shard_map, "
        "check_vma=True): where the error is a lax.cond whose branches differ "
        "in varying manual axes, a state leaf is per device in one branch and "
        "not in the other; have tx.init make it per device "
        "(jaxcomp.placement.to_varying(zeros, axis_name)), or use jaxcomp.multi_steps "
        "and jaxcomp.apply_if_finite, which do so, in place of optax's") from e
  return found[0]


def _known_per_device(state, grads_axes: list) -> list:
  """Per leaf of ``state``, the axes that a known third-party state says it
  varies over beyond what its ``init`` makes: ``optax.MultiSteps``'
  accumulator (``acc_grads``, a running sum of the per-device gradients,
  zeros from ``init``, replaced in one branch of its ``lax.cond`` and
  passed on in the other) varies as the gradient does."""
  is_multi = lambda x: isinstance(x, optax.MultiStepsState)
  nothing = lambda tree: jax.tree.map(lambda _: frozenset(), tree)

  def marks(x):  # a leaf, or a MultiStepsState node
    if not is_multi(x):
      return frozenset()
    acc = jax.tree.leaves(x.acc_grads)
    acc_axes = (grads_axes if len(acc) == len(grads_axes)
                else [frozenset().union(*grads_axes)] * len(acc))
    return x._replace(
        mini_step=frozenset(), gradient_step=frozenset(),
        inner_opt_state=jax.tree.map(marks, x.inner_opt_state, is_leaf=is_multi),
        acc_grads=jax.tree.unflatten(jax.tree.structure(x.acc_grads), acc_axes),
        skip_state=nothing(x.skip_state))

  return jax.tree.leaves(jax.tree.map(marks, state, is_leaf=is_multi),
                         is_leaf=lambda x: isinstance(x, frozenset))


def _init_probe(tx, params, mesh, params_spec):
  """``(state, params, axes)`` as one device sees them inside
  ``jax.shard_map`` when ``tx.init`` runs there (traced, nothing runs):
  ``jax.ShapeDtypeStruct`` s of the state and the parameters (local
  shapes), and per state leaf the axes it varies over."""
  init_fn = getattr(tx, "init", tx)
  found = []
  shapes = lambda tree: jax.tree.map(
      lambda x: jax.ShapeDtypeStruct(jnp.shape(x), jnp.result_type(x)), tree)

  def probe(p):
    st = init_fn(p)
    _refuse_per_device_combinators(st)
    found.append((shapes(st), shapes(p), jax.tree.map(varying_axes, st)))
    return jnp.zeros((), jnp.float32)

  jax.eval_shape(jax.shard_map(probe, mesh=mesh, in_specs=(params_spec,),
                               out_specs=P()), params)
  return found[0]


def init_shapes(tx, params, mesh, *, params_spec=P()):
  """``tx.init``'s state as one device holds it under ``jax.shard_map``
  (``jax.ShapeDtypeStruct`` leaves, local shapes; traced, nothing runs): to
  check a transform's configuration before placing its state.

  Args:
    tx: a GradientTransformation (or an ``init`` function).
    params: the parameters, placed by ``params_spec`` on ``mesh``.
    mesh: the mesh.
    params_spec: the parameters' partition spec(s).
  """
  return _init_probe(tx, params, mesh, params_spec)[0]


def _state_axes(tx, params, mesh, axis_name: AxisName, *, params_spec=P(),
                grads=None, params_vary_over: AxisName = ()):
  """``(init_axes, axes)``: per state leaf, the mesh axes it varies over as
  ``init`` makes it, and as it must be declared so that ``update`` keeps its
  type: ``init``'s axes plus those an update gives it, to a fixed point,
  each round read from JAX's types of one traced update
  (:func:`_update_axes`).

  ``tx`` is a GradientTransformation, or an ``init`` function alone (then
  both are ``init``'s). ``params`` are placed by ``params_spec``;
  ``grads``: one device's gradient where it is not shaped like one device's
  parameters (FSDP's whole-parameter gradient).

  Raises:
    PlacementError: the update does not trace per device.
  """
  local_state, params, init_axes = _init_probe(tx, params, mesh, params_spec)
  update = getattr(tx, "update", None)
  if update is None:
    return init_axes, init_axes
  is_axes = lambda x: isinstance(x, frozenset)
  cur, treedef = jax.tree.flatten(init_axes, is_leaf=is_axes)
  params_axes = [_spec_axes(s) for s in _leaf_specs(params_spec, params)]
  data = frozenset(check_axis_name(axis_name))
  if params_vary_over:  # DiLoCo's copies: the update sees them vary
    params_axes = [frozenset(check_axis_name(params_vary_over)) | a
                   for a in params_axes]
  # A gradient varies where its parameter does too (a tensor-parallel
  # shard's gradient differs over the model axis), and over the data axes
  # (FSDP's gradient of the gathered parameters: whole over the data axes
  # its shards split, given as grads).
  grads_axes = [data | a for a in params_axes]
  grads = params if grads is None else grads
  cur = [c | k for c, k in zip(cur, _known_per_device(local_state, grads_axes))]
  for _ in range(8):  # each round can only add axes: a fixed point soon
    out = _update_axes(update, (grads, local_state, params),
                       grads_axes + cur + params_axes, mesh)
    new = [c | o for c, o in zip(cur, out)]
    if new == cur:
      break
    cur = new
  return init_axes, jax.tree.unflatten(treedef, cur)


def state_partition_specs(tx, params, mesh, axis_name: AxisName):
  """Partition specs of ``tx``'s state leaves, derived from their types.

  Traces ``tx.init`` once inside ``shard_map`` (nothing runs) and reads which
  mesh axes each leaf varies over; then follows one ``tx.update`` with
  per-device gradients by data flow, so that a leaf that an update fills
  with per-device values (a gradient accumulator such as
  ``optax.MultiSteps``') is per device too. Invariant leaves get ``P()``;
  varying ones get ``P(axes)`` and are carried with a leading device axis
  (see :func:`to_local` / :func:`to_global`).

  Args:
    tx: a GradientTransformation (or an ``init`` function: then ``init``'s
      types alone decide).
    params: the (replicated) parameters.
    mesh: the mesh.
    axis_name: the data-parallel axis (or tuple of axes) the gradients vary
      over.

  Returns:
    A pytree of ``PartitionSpec`` with the structure of the state.

  Raises:
    PlacementError: ``tx.update`` does not trace per device.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data"),
    ...                  optax.adam(1e-3))
    >>> specs = jaxcomp.placement.state_partition_specs(tx, {"w": jnp.zeros((64,))},
    ...                                       mesh, "data")
    >>> specs[0].feedback  # the residual of top-k: one per device
    ((P('data',),),)
    >>> specs[1][0].mu  # Adam's moments of the averaged gradient: replicated
    {'w': P()}
  """
  _, axes = _state_axes(tx, params, mesh, axis_name)
  return jax.tree.map(lambda a: _spec_for(a, mesh), axes,
                      is_leaf=lambda x: isinstance(x, frozenset))


def to_local(tree, specs):
  """Drops the leading device axis of the varying leaves (inside shard_map).

  A per-device state leaf is held outside ``shard_map`` with a leading
  device axis, sharded ``P(axes)`` (:func:`jaxcomp.placement.init_sharded`); inside,
  each device sees a block of one and works on the leaf without it.

  Args:
    tree: the state as one device sees it inside ``shard_map``.
    specs: its partition specs (a ``PartitionSpec`` per leaf, or a prefix).

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import PartitionSpec as P
    >>> specs = {"residual": P("data"), "count": P()}
    >>> one_device = {"residual": jnp.zeros((1, 64)),
    ...               "count": jnp.zeros((), jnp.int32)}
    >>> jax.tree.map(jnp.shape, jaxcomp.placement.to_local(one_device, specs))
    {'count': (), 'residual': (64,)}
  """
  return jax.tree.map(lambda s, x: x if s == P() else x[0], specs, tree,
                      is_leaf=_is_spec)


def to_global(tree, specs):
  """Adds the leading device axis back to the varying leaves: the inverse
  of :func:`to_local`, before a state leaves ``shard_map``.

  Example:
    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import PartitionSpec as P
    >>> specs = {"residual": P("data"), "count": P()}
    >>> local = {"residual": jnp.zeros((64,)),
    ...          "count": jnp.zeros((), jnp.int32)}
    >>> jax.tree.map(jnp.shape, jaxcomp.placement.to_global(local, specs))
    {'count': (), 'residual': (1, 64)}
  """
  return jax.tree.map(lambda s, x: x if s == P() else x[None], specs, tree,
                      is_leaf=_is_spec)


def init_sharded(tx, params, mesh, axis_name: AxisName, *,
                 params_spec: P = P(), grads=None,
                 params_vary_over: AxisName = ()):
  """Initialises ``tx``'s state under ``shard_map`` and places it on ``mesh``.

  Args:
    tx: an optax GradientTransformation containing jaxcomp transforms.
    params: the parameters (replicated, or placed by ``params_spec``).
    mesh: a ``jax.sharding.Mesh`` with ``axis_name``.
    axis_name: the data-parallel axis (or tuple of axes).
    params_spec: the parameters' partition spec: ``P()`` (replicated, the
      default), one spec for every leaf (FSDP's ``P("data")``,
      :mod:`jaxcomp.fsdp`), or a pytree of specs (tensor-parallel leaves
      sharded over a ``model`` axis, say); gradients vary over
      ``axis_name`` whatever the parameters' placement.
    grads: ``jax.ShapeDtypeStruct`` s of one device's gradient, where it is
      not shaped like one device's parameters (FSDP's gradient of the whole
      parameters, :class:`jaxcomp.FSDP`).
    params_vary_over: the axes over which the update will see separate
      copies of the parameters (DiLoCo's inner steps,
      :class:`jaxcomp.Islands`: every device's own, or each island's),
      so that state computed from them is placed as it varies.

  Returns:
    ``(opt_state, specs)``: the state, whose per-device leaves have a leading
    axis of size ``prod(mesh.shape[a] for a in their axes)`` sharded with
    ``P(axes)``, and the pytree of partition specs to pass to
    :func:`shard_train_step` (or to ``jax.shard_map`` yourself).

  In a multi-process job every process then compares its transforms'
  configurations, parameter and state shapes and mesh with the others (one
  small all-gather): a process started with another hyperparameter, model
  or mesh fails here, naming the difference, before any exchange.

  Raises:
    ValueError: ``axis_name`` is empty or not an axis of ``mesh``.
    jaxcomp.distributed.AgreementError: processes disagree (see above).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data"),
    ...                  optax.adam(1e-3))
    >>> state, specs = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros((64,))},
    ...                                     mesh, "data")
    >>> specs[0].feedback  # the residual: one per device
    ((P('data',),),)
    >>> state[0].feedback[0][0].shape == (jax.device_count(), 64)
    True
  """
  check_mesh_axes(mesh, axis_name)
  check_array_leaves(params)
  params = jax.device_put(params, jax.tree.map(
      lambda s: NamedSharding(mesh, s), params_spec, is_leaf=_is_spec))
  init_axes, state_axes = _state_axes(tx, params, mesh, axis_name,
                                      params_spec=params_spec, grads=grads,
                                      params_vary_over=params_vary_over)
  is_axes = lambda x: isinstance(x, frozenset)
  specs = jax.tree.map(lambda a: _spec_for(a, mesh), state_axes,
                       is_leaf=is_axes)

  def init_global(p):
    # Leaves that an update makes per device start per device.
    st = jax.tree.map(
        lambda x, a, b: to_varying(x, tuple(sorted(b - a))) if b - a else x,
        tx.init(p), init_axes, state_axes)
    return to_global(st, specs)

  state = jax.jit(jax.shard_map(init_global, mesh=mesh,
                                in_specs=(params_spec,), out_specs=specs))(params)
  if jax.process_count() > 1:
    _check_processes_agree(state, params, mesh, axis_name)
  return state, specs


def _check_processes_agree(state, params, mesh, axis_name) -> None:
  """Every process of a multi-process job compares its transforms'
  configurations, its parameter and state shapes and its mesh with the
  others before the first exchange (one small all-gather), so that a
  process started differently fails with a message at once instead of
  aborting a collective or diverging."""
  items = [("mesh", dict(mesh.shape)), ("axis_name", axis_name)]
  for path, config in transform.transform_configs(state).items():
    items += [(f"the transform at state{path}: {k}", v)
              for k, v in sorted(config.items())]
  for name, tree in (("params", params), ("state", state)):
    items += [(f"{name}{jax.tree_util.keystr(p)}",
               f"{jnp.result_type(x)}{list(jnp.shape(x))}")
              for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]
  distributed.check_agreement(items, what="configuration")
