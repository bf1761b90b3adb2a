"""The public transform: compressed gradient averaging over a mesh axis.

The factory :func:`compressed_mean` resolves its arguments into a
:class:`~jaxcomp.transform._config.MeanSpec`; :func:`init` and :func:`update`
are functions of that spec. One gradient's path through ``update``::

  leaves --plan (jaxcomp.bucketing)--> buckets of tensors (parts: one
      flat float32 array each); the nonfinite policy screens them
    per bucket (jaxcomp.transform._exchange):
      v, ctx   = feedback.prepare(parts, feedback_state)        # jaxcomp.feedback
      mean, local, exchange_state = collective.exchange(        # jaxcomp.collectives
          compressor, v, shapes, key=..., step=count, ...)      #   -> compressor.encode
      update, feedback_state = feedback.finish(ctx, mean, local) #  / decode (kernels)
  updates <- the buckets' updates, cut back into leaves in their own dtypes

Leaves below ``min_compress_size`` skip all of it and go through one exact
``pmean``. With ``output="shard"`` the sibling path
(:func:`jaxcomp.transform._exchange.reduce_scatter`) returns each device's
shard of the mean instead.
"""

from __future__ import annotations

import dataclasses
import functools
import numbers
from typing import Any, NamedTuple
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import optax

from jaxcomp import _mesh
from jaxcomp import collectives as collectives_lib
from jaxcomp import compressors as compressors_lib
from jaxcomp import feedback as feedback_lib
from jaxcomp import wire
from jaxcomp._mesh import AxisName
from jaxcomp.transform import _config as config_lib
from jaxcomp.transform import _nonfinite as nonfinite_lib
from jaxcomp.transform._config import MeanSpec
from jaxcomp.transform._config import TransformConfig
from jaxcomp.transform._config import resolve
from jaxcomp.transform._exchange import average
from jaxcomp.transform._exchange import reduce_scatter
from jaxcomp.transform._buckets import BucketPlan
from jaxcomp.transform._buckets import check_per_device
from jaxcomp.transform._buckets import check_state
from jaxcomp.transform._buckets import plan
from jaxcomp.transform._stats import CompressionStats
from jaxcomp.transform._stats import as_arrays
from jaxcomp.transform._stats import dense_bytes_of
from jaxcomp.transform._stats import traffic_figures

NONFINITE_POLICIES = nonfinite_lib.NONFINITE_POLICIES
OUTPUTS = config_lib.OUTPUTS
# fold_in data of the key stream that initialises the collectives' states
# (e.g. PowerSGD's first Q): a step count the transform never reaches.
_INIT_STREAM = 0xFFFFFFFF


class CompressedMeanState(NamedTuple):
  """State of :func:`compressed_mean`.

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.compressed_mean("topk", "data", ratio=0.1)
    >>> state, _ = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros((8, 4))},
    ...                                 mesh, "data")
    >>> isinstance(state, jaxcomp.CompressedMeanState)
    True
    >>> int(state.count), state.config.as_dict()["compressor"]["name"]
    (0, 'topk')
  """

  config: TransformConfig  # static (no array): the transform's configuration
  #                          (transform_configs reads it)
  count: jax.Array  # shape=(), int32, steps taken (skipped ones included)
  key: jax.Array  # shape=(2,), uint32, raw PRNG key shared by all devices
  feedback: tuple  # per bucket: the feedback state (the residual: one float32
  #                  (size_i,) array per tensor in the bucket, varying over
  #                  the axis), or () without error feedback
  exchange_state: tuple  # per bucket: the collective's state (e.g. PowerSGD's
  #                        Q or a second-phase residual), or ()
  stats: CompressionStats


def transform_configs(state) -> dict[str, dict]:
  """The configuration of every :func:`compressed_mean` in an optimizer
  state, by its path in the state: the compressor and its
  hyperparameters, collective, error feedback, bucketing, nonfinite policy,
  seed and axis names (what :class:`jaxcomp.checkpoint.Checkpointer` saves
  and compares on restore). Read from the state itself (static data of its
  tree structure), so a state restored in another process is described as
  well as the one built here.

  Returns:
    ``{path string: configuration}``, in tree order; each configuration a
    dict of plain Python values (strings, numbers, None, nested dicts).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.1),
    ...                  optax.sgd(0.1))
    >>> state, _ = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros((8, 4))},
    ...                                 mesh, "data")
    >>> configs = jaxcomp.transform_configs(state)
    >>> list(configs), configs["[0]"]["compressor"]["ratio"]
    (['[0]'], 0.1)
  """
  found = {}

  def visit(path, x):
    if isinstance(x, CompressedMeanState):
      found[jax.tree_util.keystr(path)] = x.config.as_dict()

  jax.tree_util.tree_map_with_path(
      visit, state, is_leaf=lambda x: isinstance(x, CompressedMeanState))
  return found


class _Facts(NamedTuple):
  """What one bucket plan fixes (static), found once per plan."""

  state: Any  # CompressedMeanState of jax.ShapeDtypeStruct: the shapes and
  #             dtypes of the state init makes for the plan
  stats: dict  # the statistics' static fields, as Python floats


def _pad_to(x: jax.Array, n: int) -> jax.Array:
  return x if x.shape[0] == n else jnp.pad(x, (0, n - x.shape[0]))


def _leaf_update(policy, any_bad, m, leaf, shard_shape, passthrough: bool):
  """One leaf's update, in its own dtype and shape (a shard's with
  ``output="shard"``); zero (float0 kept) for a leaf left out that is not
  floating."""
  shape = jnp.shape(leaf) if shard_shape is None else shard_shape
  if passthrough:  # no update, typed invariant
    return (leaf if jnp.result_type(leaf) == jax.dtypes.float0
            else jnp.zeros(shape, jnp.result_type(leaf)))
  return policy.leaf(any_bad, m).reshape(shape).astype(leaf.dtype)


def _plan(spec: MeanSpec, tree, what: str, shards: bool = False,
            made=None) -> BucketPlan:
  return plan(tree, spec.buckets, what,
                shard_axis=spec.axis_name if spec.shard else None,
                shards=shards, axis_name=spec.axis_name, made=made)


def _config_of(spec: MeanSpec, lay: BucketPlan) -> TransformConfig:
  """The configuration, with the plan that "auto" made where it ran."""
  if not spec.plans_at_init:
    return spec.config
  return dataclasses.replace(spec.config, plan=lay.plan)


def _per_device_state(spec: MeanSpec, lay: BucketPlan):
  """``(feedback, exchange_state)``: per bucket, the feedback's state and
  the collective's (a reduce-scatter keeps none: no second phase)."""
  comp, coll, fb, _ = spec.components
  init_key = jax.random.fold_in(jax.random.key(spec.seed), _INIT_STREAM)
  return (tuple(fb.init(lay.bucket_sizes(b), spec.axis_name)
                for b in range(len(lay.shapes))),
          tuple(() if spec.shard else coll.init_state(
              comp.for_shapes(shapes), shapes,
              jax.random.fold_in(init_key, b), spec.axis_name)
                for b, shapes in enumerate(lay.shapes)))


def _static_stats(spec: MeanSpec, lay: BucketPlan, held) -> dict:
  """The statistics' fields that the bucket plan fixes, as Python floats: bytes
  and factors (from the collectives' declared transfers), state bytes (of
  ``held``, the per-device state or its shapes)."""
  comp, coll = spec.components.compressor, spec.components.collective
  axis_sizes = _mesh.axis_sizes(spec.axis_name)
  if spec.shard:
    ts = [t for b, dtype in enumerate(lay.bucket_dtypes)
          for t in coll.reduce_scatter_transfers(
              comp, sum(lay.bucket_sizes(b)), axis_sizes, dtype)]
  else:
    ts = [t for shapes, dtype in zip(lay.shapes, lay.bucket_dtypes)
          for t in coll.transfers(comp, shapes, axis_sizes, dtype)]
  nbytes = lambda i: lay.sizes[i] * lay.dtypes[i].itemsize
  averaged = [i for i in range(len(lay.sizes)) if i not in lay.passthrough]
  return traffic_figures(
      ts, wire.devices(axis_sizes),
      exact_bytes=sum(nbytes(i) for i in lay.plan.exact),
      dense_bytes=dense_bytes_of([lay.sizes[i] for i in averaged],
                                 [lay.dtypes[i] for i in averaged]),
      # The dense exchange: an all-reduce, or a reduce-scatter for shards.
      dense_kind="reduce-scatter" if spec.shard else "all-reduce",
      state_bytes=sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(held)))


def _shapes(tree):
  return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), tree)


def _facts_key(spec: MeanSpec, lay: BucketPlan) -> tuple:
  return lay.key(), tuple(_mesh.axis_sizes(spec.axis_name).items())


def _facts(spec: MeanSpec, lay: BucketPlan) -> _Facts:
  """What ``lay`` fixes, found once per bucket plan: ``init`` records it, and an
  ``update`` whose plan no ``init`` saw finds it from the shapes of the
  per-device state alone."""
  key = _facts_key(spec, lay)
  if key not in spec.facts:
    held = jax.eval_shape(functools.partial(_per_device_state, spec, lay))
    scalar = lambda dtype: jax.ShapeDtypeStruct((), dtype)
    stats = CompressionStats._make(
        scalar(jnp.int32 if f == "skipped_steps" else jnp.float32)
        for f in CompressionStats._fields)
    spec.facts[key] = _Facts(CompressedMeanState._make((
        _config_of(spec, lay), scalar(jnp.int32),
        jax.eval_shape(lambda: jax.random.key_data(jax.random.key(spec.seed))),
        held[0], held[1], stats)), _static_stats(spec, lay, held))
  return spec.facts[key]


def init(spec: MeanSpec, params) -> CompressedMeanState:
  """``compressed_mean(...).init``: the state for ``params`` (see
  :func:`compressed_mean`)."""
  axis_name = spec.axis_name
  _mesh.check_bound(axis_name, "compressed_mean.init")
  lay = _plan(spec, params, "params", shards=True)
  for b in range(len(lay.shapes)):
    spec.components.compressor.check_size(sum(lay.bucket_sizes(b)))
  feedback, exchange_state = _per_device_state(spec, lay)
  figures = _static_stats(spec, lay, (feedback, exchange_state))
  state = CompressedMeanState(
      config=_config_of(spec, lay), count=jnp.zeros((), jnp.int32),
      key=jax.random.key_data(jax.random.key(spec.seed)),
      feedback=feedback, exchange_state=exchange_state,
      stats=CompressionStats(
          **as_arrays(figures),
          residual_norm=_mesh.varying_zeros((), axis_name),
          skipped_steps=jnp.zeros((), jnp.int32)))
  spec.facts.setdefault(_facts_key(spec, lay), _Facts(_shapes(state), figures))
  return state


def update(spec: MeanSpec, updates, state: CompressedMeanState, params=None
           ) -> tuple[Any, CompressedMeanState]:
  """``compressed_mean(...).update``: the mean of ``updates`` over the axis
  and the next state (see :func:`compressed_mean`)."""
  del params
  comp, coll, _, policy = components = spec.components
  axis_name = spec.axis_name
  leaves, treedef = jax.tree.flatten(updates)
  _mesh.check_bound(axis_name, "compressed_mean.update")
  made = getattr(getattr(state, "config", None), "plan", None)
  lay = _plan(spec, updates, "gradient",
                made=made if spec.plans_at_init else None)
  check_per_device([x for i, x in enumerate(leaves)
                    if i not in lay.passthrough], axis_name)
  facts = _facts(spec, lay)
  check_state(state, facts.state)
  flat, any_bad = policy.screen([
      _pad_to(x.reshape(-1).astype(jnp.float32), lay.sizes[i])
      if i not in lay.passthrough
      else jnp.zeros((0,), jnp.float32) for i, x in enumerate(leaves)],
      axis_name)
  p = wire.devices(_mesh.axis_sizes(axis_name))
  step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key),
                                state.count)
  if spec.shard:
    ex = reduce_scatter(components, lay, flat, any_bad, state, step_key,
                        axis_name, p)
  else:
    ex = average(components, lay, flat, any_bad, state, step_key, axis_name)
  mean_leaves = [_leaf_update(policy, any_bad, ex.out[i], leaf,
                              (lay.sizes[i] // p,) if spec.shard else None,
                              i in lay.passthrough)
                 for i, leaf in enumerate(leaves)]
  # What each device holds back: the feedback's residual and the
  # collective's (a second-phase residual, Zen's overflow).
  sq = ex.sq_residual + sum(
      (jnp.sum(x * x) for b in range(len(lay.shapes))
       for x in (coll.unsent(comp, ex.exchange_state[b]) or ())),
      jnp.zeros((), jnp.float32))
  # The bytes are this transform's (a state may come from another
  # transform of the same structure, e.g. an earlier warm-up stage).
  stats = state.stats._replace(
      **as_arrays(facts.stats),
      residual_norm=_mesh.to_varying(jnp.sqrt(sq), axis_name),
      skipped_steps=state.stats.skipped_steps + any_bad.astype(jnp.int32))
  return jax.tree.unflatten(treedef, mean_leaves), CompressedMeanState(
      config=_config_of(spec, lay), count=state.count + 1, key=state.key,
      feedback=ex.feedback, exchange_state=ex.exchange_state, stats=stats)


def compressed_mean(
    compressor: str | compressors_lib.Compressor = "identity",
    axis_name: AxisName = "data",
    *,
    collective: str | collectives_lib.Collective | None = None,
    error_feedback: str | bool | feedback_lib.Feedback | None = None,
    bucketing: str = "auto",
    min_compress_size: int = 0,
    bucket_elements: int | None = None,
    bucket_bytes: int | None = None,
    plan: Sequence[Sequence[int]] | None = None,
    mask=None,
    nonfinite: str | None = None,
    seed: int = 0,
    output: str = "mean",
    **compressor_kwargs,
) -> optax.GradientTransformation:
  """Averages per-device gradients over ``axis_name``, compressed.

  Run ``init`` and ``update`` inside ``jax.shard_map`` (or ``jax.pmap``) over
  ``axis_name``, with per-device gradients (see
  :func:`jaxcomp.per_device_grad`). ``update`` returns the mean over the axis
  of what every device sent, identical on every device, in each leaf's own
  dtype; chain an optimizer after it::

    tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.01),
                     optax.adam(1e-3))

  Each bucket of leaves (see ``bucketing``) is corrected by error feedback
  leaf by leaf (the residual is kept per leaf, float32, one per device),
  flattened to one float32 buffer, encoded, exchanged by the collective,
  decoded and cut back into leaves.

  Args:
    compressor: a registered name (``jaxcomp.compressors.names()``) or a
      Compressor instance.
    axis_name: the data-parallel axis name, or a tuple of names.
    collective: None (``jaxcomp.collectives.default_for`` the compressor),
      ``"psum"``, ``"allgather"``, ``"two_phase"``, ``"zen"``,
      ``"hierarchical"``, another registered collective, or a Collective
      instance (see docs/collectives.md).
    error_feedback: ``None`` (residual error feedback for biased compressors,
      none for unbiased ones), ``True``/``"residual"``, ``False``/``"none"``,
      ``"ef21"``, ``"dgc"`` (:mod:`jaxcomp.feedback`), or a Feedback
      instance.
    bucketing: ``"auto"`` (default: a leaf of at least ``bucket_bytes``,
      default 1 MB of float32, is a bucket alone; the smaller leaves are
      packed in leaf order, by dtype, into buckets of about that size, so
      biases and norms do not each pay a collective's start-up;
      compressors bound to one tensor's shape (DCT top-k, chunked top-k)
      and plain psums of every leaf (identity, the casts: XLA combines
      their all-reduces itself) stay layer-wise, and PowerSGD compresses
      each tensor of a bucket on its own, exchanging the bucket's factors
      together; see
      :mod:`jaxcomp.bucketing`), ``"layerwise"`` (one bucket per leaf),
      ``"whole"`` (one bucket), ``"fixed"``
      (``bucket_elements`` per bucket), ``"fixed_bytes"`` (``bucket_bytes``
      per bucket) or ``"mgwfbp"`` (with
      ``plan=jaxcomp.bucketing.mgwfbp_plan_for(...)``). A biased compressor
      selects within a bucket (top-k keeps the k largest of the bucket), so
      the bucketing is part of what it computes.
    min_compress_size: leaves with fewer elements skip compression and go
      through an exact float32 ``pmean``.
    bucket_elements: bucket size in elements for ``bucketing="fixed"``.
    bucket_bytes: bucket size in bytes (float32) for
      ``bucketing="fixed_bytes"``; for ``"auto"``, the size below which
      leaves are merged (default
      :data:`jaxcomp.bucketing.DEFAULT_BUCKET_BYTES`).
    plan: explicit buckets as lists of leaf indices (``jax.tree.leaves``
      order); overrides ``bucketing``.
    mask: which leaves are compressed: None (all), a pytree of booleans
      with the parameters' structure (or a prefix of it), or a function of
      the parameters returning one, as ``optax.masked`` takes. Floating
      leaves it leaves out go through the exact float32 ``pmean`` (biases,
      norms, embeddings you want exact); others (integer, boolean) get a
      zero update (``float0`` gradients are returned as they are). ``optax.masked(compressed_mean(...), mask)`` does
      not do this: the leaves it leaves out come out per device,
      un-averaged.
    nonfinite: what a NaN or Inf in any device's gradient does to the step.
      ``"skip"``: the update is zero and the error-feedback state is left
      unchanged on every device (one extra scalar all-reduce and a pass
      over the gradient); ``"zero"``: non-finite entries are replaced by 0
      before compression; ``"propagate"``: the update is NaN on every
      device (so that ``optax.apply_if_finite`` can skip the step) and the
      error-feedback state is left unchanged; ``"none"``: no check, for a
      transform that keeps no per-device state and sends every coordinate
      (identity, the casts over ``"psum"``), where a NaN reaches every
      device's mean as in a plain all-reduce. ``None`` (default):
      ``"none"`` where it applies (so that ``compressed_mean("identity")``
      compiles to the plain step), else ``"skip"``. No policy lets NaN into
      the residual. To skip the whole step (the optimizer's moments too),
      wrap the chain in :func:`jaxcomp.apply_if_finite`.
    seed: seed of the key shared by all devices, an integer in
      ``[-2**63, 2**63)`` (random-block placement,
      QSGD rounding, ...).
    output: ``"mean"`` (default): every device gets the whole mean, as
      above. ``"shard"``: a compressed *reduce-scatter* for sharded data
      parallelism (FSDP / ZeRO-3, :mod:`jaxcomp.fsdp`): the parameters are
      flat shards (leaf ``i`` of ``n_i`` elements is held as ``c_i =
      ceil(n_i / p)`` elements per device, zero-padded, device ``j``
      holding elements ``[j c_i, (j + 1) c_i)``), ``init`` takes those
      shards, ``update`` takes the per-device gradient of the *whole*
      parameters (their shapes) and returns this device's shard of the
      mean, float ``(c_i,)`` per leaf (varying over the axis), for the
      optimizer after it to update the shards. Linear compressors are
      summed in flight by ``lax.psum_scatter`` of per-chunk payloads
      (``identity`` gives exactly ``psum_scatter(g) / p``); the others go
      through phase 1 of the two-phase exchange (an all-to-all of chunk
      payloads, decoded and summed by each chunk's owner; ZeRO++'s qgZ).
      Error feedback, where used, keeps one gradient-sized float32 residual
      per device (``stats.state_bytes``), memory that FSDP otherwise does
      not spend: unbiased quantizers without it (``error_feedback=False``)
      are the sharded default to reach for.
    **compressor_kwargs: hyperparameters of a compressor given by name.

  Returns:
    An ``optax.GradientTransformation`` whose state is
    :class:`CompressedMeanState`.

  Raises:
    ValueError: at construction, for an unknown compressor, collective,
      feedback, bucketing, nonfinite policy or ``output``, a bad
      hyperparameter, a ``seed`` or ``min_compress_size`` that is not an
      integer in range, a bucket size the bucketing strategy does not
      read, an empty ``axis_name``, a collective that cannot
      carry the compressor, or, with ``output="shard"``, a compressor with
      an exchange of its own (PowerSGD, TernGrad, majority vote), a
      collective with no reduce-scatter (``"hierarchical"``, ``"zen"``) or
      feedback that keeps the whole mean (``"ef21"``); in ``init``, with
      ``output="shard"``, for parameters that are not flat shards.
    TypeError: in ``init``/``update``, for integer or boolean leaves that
      ``mask`` does not leave out, or for a gradient JAX already summed over
      the devices (plain ``jax.grad`` inside ``shard_map``).
    NameError: in ``init``/``update``, when ``axis_name`` is not bound
      (called outside ``shard_map``/``pmap``).

  Example:
    >>> import jax, jax.numpy as jnp, optax, jaxcomp
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.1),
    ...                  optax.sgd(0.1))
    >>> state, specs = jaxcomp.placement.init_sharded(tx, {"w": jnp.zeros((8, 4))},
    ...                                     mesh, "data")
    >>> stats = jaxcomp.get_stats(state)  # 4 of 32 values + their indices
    >>> float(stats.bytes_sent), float(stats.dense_bytes)
    (32.0, 128.0)

  References:
    Lin et al., Deep Gradient Compression <https://arxiv.org/abs/1712.01887>,
    2018 (compression inside data-parallel training); Agarwal et al., On the
    Utility of Gradient Compression in Distributed Training Systems
    <https://arxiv.org/abs/2103.00543>, 2022 (when it pays).
  """
  spec = resolve(
      compressor, axis_name, collective=collective,
      error_feedback=error_feedback, bucketing=bucketing,
      min_compress_size=min_compress_size, bucket_elements=bucket_elements,
      bucket_bytes=bucket_bytes, plan=plan, mask=mask, nonfinite=nonfinite,
      seed=seed, output=output, compressor_kwargs=compressor_kwargs)
  # optax's OptState (a tree of arrays) admits no static config field.
  return optax.GradientTransformation(
      functools.partial(init, spec),  # pyright: ignore[reportArgumentType]
      functools.partial(update, spec))  # pyright: ignore[reportArgumentType]


def over_axes(tx: optax.GradientTransformation, axis_name: AxisName, *,
              output: str = "mean") -> optax.GradientTransformation:
  """The same :func:`compressed_mean` over other mesh axes: its compressor
  and hyperparameters, error feedback, bucketing, nonfinite policy and
  seed, averaging over ``axis_name`` (``output="mean"``) or
  reduce-scattering over it (``output="shard"``). For a layout that
  splits one exchange in two, as
  :class:`jaxcomp.gspmd.CompressedValueAndGrad` does for parameters GSPMD shards
  over a data axis: a reduce-scatter over the axes that shard them, then
  the shards' mean over the other data axes (HSDP).

  A reduce-scatter takes the compressor's default collective (one with a
  reduce-scatter), a mean the collective ``tx`` was given.

  Args:
    tx: a ``compressed_mean(...)`` (not a chain holding one).
    axis_name: the mesh axis or axes of the new transform.
    output: ``"mean"`` or ``"shard"``, as :func:`compressed_mean` takes.

  Returns:
    A ``compressed_mean`` with those arguments changed.

  Raises:
    ValueError: ``tx`` is not a ``compressed_mean``; what
      :func:`compressed_mean` raises for the new arguments (e.g.
      ``output="shard"`` with PowerSGD, whose exchange is its own).

  Example:
    >>> import jaxcomp
    >>> tx = jaxcomp.compressed_mean("int8_block", ("data", "fsdp"), bits=4)
    >>> rs = jaxcomp.transform.over_axes(tx, "fsdp", output="shard")
  """
  spec = _spec_of(tx, "over_axes")
  arguments: dict[str, Any] = dict(
      spec.arguments, axis_name=axis_name, output=output)
  if output == "shard":
    arguments["collective"] = None
  kwargs = arguments.pop("compressor_kwargs")
  compressor = arguments.pop("compressor")
  return compressed_mean(compressor, **arguments, **kwargs)


def _spec_of(tx: optax.GradientTransformation, caller: str) -> MeanSpec:
  """The spec of ``tx``, a ``compressed_mean(...)``; ValueError otherwise."""
  spec = getattr(tx.init, "args", (None,))[0] if isinstance(
      tx.init, functools.partial) and tx.init.func is init else None
  if not isinstance(spec, MeanSpec):
    raise ValueError(
        f"{caller} takes a jaxcomp.compressed_mean(...) itself, not a chain "
        "or another transformation: pass the compressed_mean")
  return spec


def with_cadence(tx: optax.GradientTransformation,
                 every: int) -> optax.GradientTransformation:
  """The same :func:`compressed_mean`, run once per ``every`` steps by the
  transform that holds it (:func:`jaxcomp.diloco`'s pseudo-gradient mean,
  every ``sync_every`` steps): its state says so
  (``TransformConfig.every``), and :func:`jaxcomp.get_stats` reports its
  bytes as per ``every`` steps, apart from the exchanges of every step.
  The exchange itself is unchanged: the holder decides when it runs.

  Args:
    tx: a ``compressed_mean(...)`` (not a chain holding one).
    every: steps per exchange, an integer >= 1.

  Returns:
    A ``compressed_mean`` whose state records ``every``.

  Raises:
    ValueError: ``tx`` is not a ``compressed_mean``, or ``every`` is not an
      integer >= 1.
  """
  spec = _spec_of(tx, "with_cadence")
  if (isinstance(every, bool) or not isinstance(every, numbers.Integral)
      or every < 1):
    raise ValueError(f"every must be an integer >= 1, got {every=!r}")
  spec = dataclasses.replace(
      spec, config=dataclasses.replace(spec.config, every=int(every)), facts={})
  return optax.GradientTransformation(
      functools.partial(init, spec),  # pyright: ignore[reportArgumentType]
      functools.partial(update, spec))  # pyright: ignore[reportArgumentType]


def in_micro_steps(state, every_k: int):
  """``state`` with every :func:`compressed_mean` state in it marked as run
  once per ``every_k`` calls of the train step (``TransformConfig.
  micro_steps``): :func:`jaxcomp.multi_steps` marks its inner state so, and
  :func:`jaxcomp.get_stats` reports those exchanges' cadence as ``every *
  every_k`` calls. Static data only: the arrays are unchanged."""
  def mark(x):
    if isinstance(x, CompressedMeanState):
      return x._replace(config=dataclasses.replace(
          x.config, micro_steps=int(every_k)))
    return x

  return jax.tree.map(mark, state,
                      is_leaf=lambda x: isinstance(x, CompressedMeanState))
