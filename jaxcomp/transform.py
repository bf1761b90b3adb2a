"""The public transform: compressed gradient averaging over a mesh axis.

One gradient's path through :func:`compressed_mean`'s ``update``::

  leaves --bucketing--> buckets of tensors (parts: one flat float32 array each)
    per bucket:
      v, ctx   = feedback.prepare(parts, feedback_state)        # jaxcomp.feedback
      mean, local, exchange_state = collective.exchange(        # jaxcomp.collectives
          compressor, v, shapes, key=..., step=count, ...)      #   -> compressor.encode
      update, feedback_state = feedback.finish(ctx, mean, local) #  / decode (kernels)
  updates <- the buckets' updates, cut back into leaves in their own dtypes

Leaves below ``min_compress_size`` skip all of it and go through one exact
``pmean``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import numbers
from typing import NamedTuple, Sequence

import jax
import jax.numpy as jnp
from jax import lax
import numpy as np
import optax

from jaxcomp import _mesh
from jaxcomp import _parts
from jaxcomp import bucketing as bucketing_lib
from jaxcomp import collectives as collectives_lib
from jaxcomp import compressors as compressors_lib
from jaxcomp import feedback as feedback_lib
from jaxcomp import wire
from jaxcomp._mesh import AxisName

NONFINITE_POLICIES = ("skip", "zero", "propagate")
# fold_in data of the key stream that initialises the collectives' states
# (e.g. PowerSGD's first Q): a step count the transform never reaches.
_INIT_STREAM = 0xFFFFFFFF


class CompressionStats(NamedTuple):
  """Per-step statistics, carried in the state (read with :func:`get_stats`).

  Two measures of one step's traffic, per device, each with the dense
  all-reduce of the same gradient beside it:

  * operand bytes (``bytes_sent``, ``dense_bytes``): what this device hands
    to collectives (the compressor payloads plus the exact leaves), what
    compression shrinks and what :func:`jaxcomp.collective_traffic` reads
    as ``operand_bytes``;
  * wire bytes (``wire_bytes``, ``dense_wire_bytes``): what this device
    sends over the links by the ring algorithms for its collectives and
    device count (:mod:`jaxcomp.wire`; ``Traffic.ring_bytes``). All-gather
    based exchanges grow with the device count here, so this is the basis
    on which to compare with a dense all-reduce: on 8 devices top-k at 1%
    is 50x fewer operand bytes but 12.5x fewer wire bytes.

  A compression factor is dense over compressed (higher is fewer bytes).
  The non-finite flag (one scalar all-reduce) is not counted.
  """

  bytes_sent: jax.Array  # shape=(), float32, operand bytes per device per step
  dense_bytes: jax.Array  # shape=(), float32, of a dense all-reduce
  compression_factor: jax.Array  # shape=(), float32, dense_bytes / bytes_sent
  wire_bytes: jax.Array  # shape=(), float32, ring bytes per device per step
  dense_wire_bytes: jax.Array  # shape=(), float32, of a dense all-reduce
  wire_compression_factor: jax.Array  # shape=(), float32, dense_wire / wire
  residual_norm: jax.Array  # shape=(), float32, this device's L2 residual
  skipped_steps: jax.Array  # shape=(), int32, steps skipped for non-finite
  state_bytes: jax.Array  # shape=(), float32, bytes of per-device state
  #                         (error feedback, the collective's) on each device


class CompressedMeanState(NamedTuple):
  """State of :func:`compressed_mean`."""

  config: jax.Array  # shape=(2,), uint32, digest of the transform's
  #                    configuration (:func:`transform_configs` reads it)
  count: jax.Array  # shape=(), int32, steps taken (skipped ones included)
  key: jax.Array  # shape=(2,), uint32, raw PRNG key shared by all devices
  feedback: tuple  # per bucket: the feedback state (the residual: one float32
  #                  (size_i,) array per tensor in the bucket, varying over
  #                  the axis), or () without error feedback
  exchange_state: tuple  # per bucket: the collective's state (e.g. PowerSGD's
  #                        Q or a second-phase residual), or ()
  stats: CompressionStats


# digest -> configuration of every compressed_mean built in this process.
_CONFIGS: dict[tuple[int, int], dict] = {}


def _describe(value):
  """A JSON-able description of a configuration value (a scheduled, traced
  hyperparameter is ``"scheduled"``)."""
  if isinstance(value, jax.core.Tracer):
    return "scheduled"
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {"name": getattr(value, "name", type(value).__name__),
            **{f.name: _describe(getattr(value, f.name))
               for f in dataclasses.fields(value) if f.init}}
  if isinstance(value, (list, tuple)):
    return [_describe(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return repr(value)


def _config_digest(config: dict) -> tuple[int, int]:
  h = hashlib.sha256(json.dumps(config, sort_keys=True).encode()).digest()
  return (int.from_bytes(h[:4], "little"), int.from_bytes(h[4:8], "little"))


def transform_configs(state) -> dict[str, dict]:
  """The configuration of every :func:`compressed_mean` in an optimizer
  state, by its path in the state: the compressor and its
  hyperparameters, collective, error feedback, bucketing, nonfinite policy,
  seed and axis names (what :class:`jaxcomp.checkpoint.Checkpointer` saves
  and compares on restore).

  Raises:
    ValueError: a state of a transform built in another process (its
      configuration is known only where it was built).
  """
  found = {}

  def visit(path, x):
    if isinstance(x, CompressedMeanState):
      digest = np.asarray(jax.device_get(x.config)).reshape(-1, 2)[0]
      key = (int(digest[0]), int(digest[1]))
      if key not in _CONFIGS:
        raise ValueError(
            f"state{jax.tree_util.keystr(path)} was made by a compressed_mean "
            "this process did not build; build the transform first")
      found[jax.tree_util.keystr(path)] = _CONFIGS[key]

  jax.tree_util.tree_map_with_path(
      visit, state, is_leaf=lambda x: isinstance(x, CompressedMeanState))
  return found


def _leaf_flags(tree, mask) -> list[bool]:
  """Per leaf of ``tree`` (``jax.tree.leaves`` order), whether ``mask``
  selects it for compression.

  Raises:
    ValueError: ``mask`` does not fit ``tree``'s structure.
  """
  leaves = jax.tree.leaves(tree)
  if mask is None:
    return [True] * len(leaves)
  m = mask(tree) if callable(mask) else mask
  try:
    flags = jax.tree.leaves(jax.tree.map(
        lambda f, sub: jax.tree.map(lambda _: bool(f), sub), m, tree))
  except (ValueError, TypeError) as e:
    raise ValueError(
        "compressed_mean: mask must be a pytree of booleans with the "
        "structure of the parameters (or a prefix of it), or a function of "
        f"the parameters returning one: {e}") from None
  return flags


def _check_floating(leaves, flags, what: str) -> None:
  for i, (leaf, f) in enumerate(zip(leaves, flags)):
    dtype = jnp.result_type(leaf)
    if f and not jnp.issubdtype(dtype, jnp.floating):
      raise TypeError(
          f"compressed_mean: {what} leaf {i} has dtype {dtype}; only floating "
          "gradients can be averaged. Leave integer and boolean leaves out "
          "with compressed_mean(..., mask=...) (their update is then zero) "
          "or make them floats.")


def _check_per_device(tree, axis_name) -> None:
  """Raises TypeError when a gradient leaf is typed invariant over
  ``axis_name``: JAX already summed it over the devices (plain ``jax.grad``
  inside ``shard_map`` w.r.t. replicated parameters), so compressing it would
  save nothing and the mean would come out ``p`` times too large."""
  if not _mesh.types_track_devices(axis_name):
    return  # pmap: every value is per device
  names = set(_mesh.axes(axis_name))
  for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
    if not names <= _mesh.varying_axes(leaf):
      raise TypeError(
          f"compressed_mean.update: the gradient leaf "
          f"{jax.tree_util.keystr(path) or '(root)'} is identical on every "
          f"device along {axis_name!r}: JAX already summed it over the "
          "devices, which is what plain jax.grad returns inside shard_map "
          "for replicated parameters. Compute the gradient with "
          f"jaxcomp.per_device_value_and_grad(loss_fn, {axis_name!r}) (or "
          "jax.grad of the parameters after jaxcomp.to_varying) so that "
          "each device compresses its own gradient.")


def _check_state(state, expected) -> None:
  """Raises ValueError naming the first leaf where ``state`` differs in
  structure, shape or dtype from ``expected`` (the state ``init`` would make
  for this gradient)."""
  got = jax.tree_util.tree_flatten_with_path(state)
  want = jax.tree_util.tree_flatten_with_path(expected)
  if got[1] != want[1]:
    got_paths = [jax.tree_util.keystr(p) for p, _ in got[0]]
    want_paths = [jax.tree_util.keystr(p) for p, _ in want[0]]
    first = next((g, w) for g, w in zip(got_paths + ["(end)"],
                                        want_paths + ["(end)"]) if g != w)
    raise ValueError(
        "compressed_mean.update: the state does not fit this gradient: its "
        f"structure differs first at {first[0]} where {first[1]} was "
        f"expected ({len(got_paths)} leaves given, {len(want_paths)} "
        "expected). Initialise the state (jaxcomp.init_sharded) with "
        "parameters of the same structure and shapes as the gradients.")
  for (path, g), (_, w) in zip(got[0], want[0]):
    if jnp.shape(g) != w.shape or jnp.result_type(g) != w.dtype:
      raise ValueError(
          f"compressed_mean.update: the state leaf "
          f"{jax.tree_util.keystr(path)} has shape {jnp.shape(g)} and dtype "
          f"{jnp.result_type(g)}, but this gradient needs {w.shape} "
          f"{w.dtype}: the state was made for another model, bucketing or "
          "compressor. Initialise it (jaxcomp.init_sharded) with parameters "
          "of the same structure and shapes as the gradients.")


def traffic_stats(transfers, p: int, *, exact_bytes: int, dense_bytes: int,
                  dense_kind: str, state_bytes: int) -> dict:
  """The static fields of :class:`CompressionStats` (float32 scalars) for an
  exchange issuing ``transfers`` plus ``exact_bytes`` sent densely by a
  ``dense_kind`` collective over ``p`` devices, against ``dense_bytes`` sent
  that way; ``state_bytes`` of per-device state."""
  sent = wire.operand_bytes(transfers) + exact_bytes
  on_wire = (wire.total_ring_bytes(transfers)
             + wire.ring_bytes(dense_kind, exact_bytes, p))
  dense_wire = wire.ring_bytes(dense_kind, dense_bytes, p)
  f32 = lambda v: jnp.asarray(float(v), jnp.float32)
  return dict(bytes_sent=f32(sent), dense_bytes=f32(dense_bytes),
              compression_factor=f32(dense_bytes / max(sent, 1)),
              wire_bytes=f32(on_wire), dense_wire_bytes=f32(dense_wire),
              wire_compression_factor=f32(
                  dense_wire / on_wire if on_wire else 1.0),
              state_bytes=f32(state_bytes))


OUTPUTS = ("mean", "shard")


def _check_output(output, comp, coll, fb) -> None:
  """Construction-time checks of ``compressed_mean(output=...)``."""
  if output not in OUTPUTS:
    raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
  if output == "mean":
    return
  if comp.own_exchange:
    raise ValueError(
        f"output='shard' cannot use compressor {comp.name!r}: it runs its own "
        "exchange of whole tensors; use a quantizer or a sparsifier (e.g. "
        "'int8_block', 'qsgd', 'topk')")
  if not coll.reduce_scatter:
    raise ValueError(
        f"output='shard' needs a collective with a reduce-scatter; "
        f"collective={coll.name!r} has none: leave collective=None")
  if fb.keeps_mean:
    raise ValueError(
        f"output='shard' cannot use error_feedback={fb.name!r}: it keeps the "
        "whole mean on every device; use 'residual', 'dgc' or False")


def _check_flat_shards(tree, what: str) -> None:
  bad = [jax.tree_util.keystr(path) for path, x in
         jax.tree_util.tree_flatten_with_path(tree)[0] if jnp.ndim(x) != 1]
  if bad:
    raise ValueError(
        f"compressed_mean(output='shard').init takes flat parameter shards "
        f"(one 1-D array per leaf, as jaxcomp.fsdp.shard_params makes them); "
        f"the {what} leaves {', '.join(bad[:3])} are not 1-D")


def _pad_to(x: jax.Array, n: int) -> jax.Array:
  return x if x.shape[0] == n else jnp.pad(x, (0, n - x.shape[0]))


class _Layout(NamedTuple):
  """How one gradient's leaves are cut into buckets (static)."""

  sizes: list  # elements per leaf
  dtypes: list  # per leaf: its dtype
  plan: bucketing_lib.BucketPlan  # exact: averaged by one pmean per dtype
  shapes: list  # per bucket: the shapes of its tensors
  bucket_dtypes: list  # per bucket: the dtype it travels in (its leaves'
  #                      common dtype, float32 where they differ)
  passthrough: tuple  # leaves left out by the mask that are not floating:
  #                     their update is zero

  def bucket_sizes(self, b: int) -> list[int]:
    return [self.sizes[i] for i in self.plan.buckets[b]]


def compressed_mean(
    compressor: str | compressors_lib.Compressor = "identity",
    axis_name: AxisName = "data",
    *,
    collective: str | collectives_lib.Collective | None = None,
    error_feedback: str | bool | feedback_lib.Feedback | None = None,
    bucketing: str = "layerwise",
    min_compress_size: int = 0,
    bucket_elements: int | None = None,
    bucket_bytes: int | None = None,
    plan: Sequence[Sequence[int]] | None = None,
    mask=None,
    nonfinite: str = "skip",
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
    bucketing: ``"layerwise"`` (one bucket per leaf), ``"whole"`` (one
      bucket), ``"fixed"`` (``bucket_elements`` per bucket),
      ``"fixed_bytes"`` (``bucket_bytes`` per bucket) or ``"mgwfbp"`` (with
      ``plan=jaxcomp.bucketing.mgwfbp_plan_for(...)``).
    min_compress_size: leaves with fewer elements skip compression and go
      through an exact float32 ``pmean``.
    bucket_elements: bucket size in elements for ``bucketing="fixed"``.
    bucket_bytes: bucket size in bytes (float32) for
      ``bucketing="fixed_bytes"``.
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
      ``"skip"`` (default): the update is zero and the error-feedback state
      is left unchanged on every device (one extra scalar all-reduce);
      ``"zero"``: non-finite entries are replaced by 0 before compression;
      ``"propagate"``: the update is NaN on every device (so that
      ``optax.apply_if_finite`` can skip the step) and the error-feedback
      state is left unchanged. No policy lets NaN into the residual.
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
    >>> state, specs = jaxcomp.init_sharded(tx, {"w": jnp.zeros((8, 4))},
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
  _mesh.check_axis_name(axis_name)
  comp = compressors_lib.get(compressor, **compressor_kwargs)
  coll = collectives_lib.get(collective, comp, axis_name=axis_name)
  fb = feedback_lib.get(error_feedback, comp.biased)
  if nonfinite not in NONFINITE_POLICIES:
    raise ValueError(
        f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite=}")
  if (isinstance(min_compress_size, bool)
      or not isinstance(min_compress_size, numbers.Integral)
      or min_compress_size < 0):
    raise ValueError("min_compress_size must be an integer >= 0, got "
                     f"{min_compress_size=!r}")
  # jax.random.key takes a seed that fits int64; found later, in init, an
  # OverflowError would name nothing.
  if (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
      or not -2**63 <= seed < 2**63):
    raise ValueError(f"seed must be an integer in [-2**63, 2**63), got "
                     f"{seed=!r}")
  _check_output(output, comp, coll, fb)
  shard = output == "shard"
  bucketing_lib.check_config(bucketing, bucket_elements=bucket_elements,
                             bucket_bytes=bucket_bytes, plan=plan)
  config = {k: _describe(v) for k, v in {
      "compressor": comp, "collective": coll, "error_feedback": fb,
      "axis_name": axis_name, "bucketing": bucketing,
      "min_compress_size": min_compress_size,
      "bucket_elements": bucket_elements, "bucket_bytes": bucket_bytes,
      "plan": plan, "mask": None if mask is None else "given",
      "nonfinite": nonfinite, "seed": seed, "output": output}.items()}
  digest = _config_digest(config)
  _CONFIGS[digest] = config
  # numpy, not jnp: readable while an init is traced (multi_steps looks for
  # an output="shard" transform in its inner state).
  config_array = np.asarray(digest, np.uint32)

  def layout(tree, what: str, shards: bool = False) -> _Layout:
    """``shards``: ``tree`` holds flat parameter shards (``output="shard"``'s
    ``init``), not tensors of the whole shapes."""
    leaves = jax.tree.leaves(tree)
    flags = _leaf_flags(tree, mask)
    _check_floating(leaves, flags, what)
    sizes = [math.prod(jnp.shape(x)) for x in leaves]
    if shard:
      # Every leaf as p chunks of c = ceil(n / p) elements (zero-padded).
      p = wire.devices(_mesh.axis_sizes(axis_name))
      if shards:
        _check_flat_shards(tree, what)
        sizes = [p * n for n in sizes]
      else:
        sizes = [p * collectives_lib.chunk_size(n, p) for n in sizes]
    passthrough = tuple(
        i for i, x in enumerate(leaves)
        if not jnp.issubdtype(jnp.result_type(x), jnp.floating))
    # Leaves the mask leaves out are planned as empty, which sends them to
    # the exact group (and out of an explicit plan).
    bplan = bucketing_lib.plan_buckets(
        [n if f else 0 for n, f in zip(sizes, flags)], strategy=bucketing,
        min_size=min_compress_size, bucket_elements=bucket_elements,
        bucket_bytes=bucket_bytes, plan=plan)
    buckets = tuple(b for b in (tuple(i for i in b if flags[i])
                                for b in bplan.buckets) if b)
    exact = tuple(sorted(set(range(len(leaves))) - set(passthrough)
                         - {i for b in buckets for i in b}))
    shapes = [tuple((sizes[i],) if shard else tuple(jnp.shape(leaves[i]))
                    for i in b) for b in buckets]
    dtypes = [jnp.dtype(jnp.result_type(x)) for x in leaves]
    bucket_dtypes = [dtypes[b[0]] if len({dtypes[i] for i in b}) == 1
                     else jnp.dtype(jnp.float32) for b in buckets]
    return _Layout(sizes, dtypes, bucketing_lib.BucketPlan(exact, buckets),
                   shapes, bucket_dtypes, passthrough)

  def static_stats(lay: _Layout) -> dict:
    axis_sizes = _mesh.axis_sizes(axis_name)
    p = wire.devices(axis_sizes)
    if shard:
      ts = [t for b, dtype in enumerate(lay.bucket_dtypes)
            for t in coll.reduce_scatter_transfers(
                comp, sum(lay.bucket_sizes(b)), axis_sizes, dtype)]
    else:
      ts = [t for shapes, dtype in zip(lay.shapes, lay.bucket_dtypes)
            for t in coll.transfers(comp, shapes, axis_sizes, dtype)]
    nbytes = lambda i: lay.sizes[i] * lay.dtypes[i].itemsize
    return traffic_stats(
        ts, p, exact_bytes=sum(nbytes(i) for i in lay.plan.exact),
        dense_bytes=sum(nbytes(i) for i in range(len(lay.sizes))
                        if i not in lay.passthrough),
        # The dense exchange: an all-reduce, or a reduce-scatter for shards.
        dense_kind="reduce-scatter" if shard else "all-reduce",
        state_bytes=state_bytes(lay))

  def state_bytes(lay: _Layout) -> int:
    """Bytes of per-device state this transform keeps (error feedback, the
    collectives' state), from the state's types."""
    st = jax.eval_shape(lambda: make_state(lay, stats=False))
    return sum(x.size * x.dtype.itemsize
               for x in jax.tree.leaves((st.feedback, st.exchange_state)))

  def make_state(lay: _Layout, stats: bool = True):
    key = jax.random.key(seed)
    init_key = jax.random.fold_in(key, _INIT_STREAM)
    return CompressedMeanState(
        config=config_array,
        count=jnp.zeros((), jnp.int32),
        key=jax.random.key_data(key),
        feedback=tuple(fb.init(lay.bucket_sizes(b), axis_name)
                       for b in range(len(lay.shapes))),
        # A reduce-scatter keeps no exchange state (no second phase).
        exchange_state=tuple(
            () if shard else coll.init_state(
                comp, shapes, jax.random.fold_in(init_key, b), axis_name)
            for b, shapes in enumerate(lay.shapes)),
        stats=CompressionStats(
            **static_stats(lay),
            residual_norm=_mesh.varying_zeros((), axis_name),
            skipped_steps=jnp.zeros((), jnp.int32)) if stats else None)

  def init_fn(params):
    _mesh.check_bound(axis_name, "compressed_mean.init")
    lay = layout(params, "params", shards=True)
    for b in range(len(lay.shapes)):
      comp.check_size(sum(lay.bucket_sizes(b)))
    return make_state(lay)

  def screen(flat):
    """``(flat, any_bad)``: the gradient as the nonfinite policy sends it,
    and whether any device's gradient had a NaN or Inf (invariant)."""
    local_bad = jnp.zeros((), jnp.bool_)
    for x in flat:
      local_bad = local_bad | ~jnp.all(jnp.isfinite(x))
    if nonfinite == "zero":
      return ([jnp.where(jnp.isfinite(x), x, 0.0) for x in flat],
              jnp.zeros((), jnp.bool_))
    # Every device of the mesh decides together, also over axes beyond this
    # transform's (HSDP's devices before its hosts, a model axis): a step
    # skipped on some replicas only would let them drift apart.
    everywhere = tuple(dict.fromkeys(_mesh.bound_axes() + _mesh.axes(axis_name)))
    any_bad = lax.psum(_mesh.to_varying(local_bad.astype(jnp.int32),
                                        everywhere), everywhere) > 0
    if nonfinite == "skip":
      # Compress zeros instead, so no NaN travels or reaches any state.
      return [jnp.where(any_bad, jnp.zeros_like(x), x) for x in flat], any_bad
    return [jnp.where(jnp.isfinite(x), x, 0.0) for x in flat], any_bad

  def update_fn(updates, state, params=None):
    del params
    leaves, treedef = jax.tree.flatten(updates)
    lay = layout(updates, "gradient")
    _mesh.check_bound(axis_name, "compressed_mean.update")
    _check_per_device([x for i, x in enumerate(leaves)
                       if i not in lay.passthrough], axis_name)
    _check_state(state, jax.eval_shape(lambda: make_state(lay)))
    flat, any_bad = screen([
        _pad_to(x.reshape(-1).astype(jnp.float32), lay.sizes[i])
        if i not in lay.passthrough
        else jnp.zeros((0,), jnp.float32) for i, x in enumerate(leaves)])
    p = wire.devices(_mesh.axis_sizes(axis_name))
    step_key = jax.random.fold_in(jax.random.wrap_key_data(state.key),
                                  state.count)
    out = [None] * len(leaves)
    for dtype in dict.fromkeys(lay.dtypes[i] for i in lay.plan.exact):
      # One exact pmean per dtype, in that dtype (a bf16 leaf sends bf16).
      group = [i for i in lay.plan.exact if lay.dtypes[i] == dtype]
      parts = tuple(flat[i].astype(dtype) for i in group)
      if shard:
        mean = lax.psum_scatter(_parts.chunk_major(parts, p).reshape(p, -1),
                                axis_name, scatter_dimension=0) / p
        mean = _parts.split(mean, [lay.sizes[i] // p for i in group])
      else:
        mean = _parts.split(lax.pmean(_parts.concat(parts), axis_name),
                            [lay.sizes[i] for i in group])
      for i, m in zip(group, mean):
        out[i] = m.astype(jnp.float32)
    new_fb, new_exchange = [], []
    sq_residual = jnp.zeros((), jnp.float32)
    for b, bucket in enumerate(lay.plan.buckets):
      v, ctx = fb.prepare(tuple(flat[i] for i in bucket), state.feedback[b])
      # The bucket travels in its gradient's own dtype; the feedback keeps
      # float32, and the rounding to that dtype is part of what it keeps.
      dtype = lay.bucket_dtypes[b]
      bucket_key = coll.device_key(comp, jax.random.fold_in(step_key, b),
                                   axis_name)
      if shard:
        mean, local = coll.reduce_scatter_flat(
            comp, _parts.chunk_major(v, p).astype(dtype), bucket_key,
            axis_name)
        sizes = lay.bucket_sizes(b)
        mean = _parts.split(mean, [n // p for n in sizes])
        local, estate = _parts.from_chunk_major(local, sizes, p), ()
      else:
        mean, local, estate = coll.exchange(
            comp, tuple(x.astype(dtype) for x in v), lay.shapes[b],
            key=bucket_key, step=state.count, axis_name=axis_name,
            state=state.exchange_state[b])
      mean, fstate = fb.finish(ctx, mean, local)
      if nonfinite != "zero":
        # A skipped step sends nothing and leaves no trace in the state.
        fstate, estate = jax.tree.map(
            lambda new, old: jnp.where(any_bad, old, new), (fstate, estate),
            (state.feedback[b], state.exchange_state[b]))
        if nonfinite == "skip":
          mean = tuple(jnp.where(any_bad, 0.0, m) for m in mean)
      new_fb.append(fstate)
      new_exchange.append(estate)
      r = fb.residual(fstate)
      if r is not None:
        sq_residual = sq_residual + sum(jnp.sum(x * x) for x in r)
      for i, m in zip(bucket, mean):
        out[i] = m

    mean_leaves = []
    for i, (m, leaf) in enumerate(zip(out, leaves)):
      shape = (lay.sizes[i] // p,) if shard else jnp.shape(leaf)
      if i in lay.passthrough:  # no update, typed invariant
        mean_leaves.append(leaf if jnp.result_type(leaf) == jax.dtypes.float0
                           else jnp.zeros(shape, jnp.result_type(leaf)))
        continue
      if nonfinite == "propagate":
        m = jnp.where(any_bad, jnp.nan, m)
      mean_leaves.append(m.reshape(shape).astype(leaf.dtype))
    # The bytes are this transform's (a state may come from another
    # transform of the same structure, e.g. an earlier warm-up stage).
    stats = state.stats._replace(
        **static_stats(lay),
        residual_norm=_mesh.to_varying(jnp.sqrt(sq_residual), axis_name),
        skipped_steps=state.stats.skipped_steps + any_bad.astype(jnp.int32))
    new_state = CompressedMeanState(
        config=config_array, count=state.count + 1,
        key=state.key, feedback=tuple(new_fb),
        exchange_state=tuple(new_exchange), stats=stats)
    return jax.tree.unflatten(treedef, mean_leaves), new_state

  return optax.GradientTransformation(init_fn, update_fn)


def get_stats(state, *, by_path: bool = False):
  """The statistics of the :func:`compressed_mean` transforms (and
  :func:`jaxcomp.demo`) in an optimizer state (e.g. the state of an ``optax.chain``, a
  ``multi_transform`` or a :func:`jaxcomp.multi_steps`).

  Args:
    state: an optimizer state (global or per-device view).
    by_path: return each transform's :class:`CompressionStats` by its path
      in ``state`` instead of one total.

  Returns:
    With ``by_path=False``: one :class:`CompressionStats` totalling every
    transform found (bytes and skipped steps add up, the compression factors
    are the totals' quotients, the residual norms combine as the norm of
    the concatenated residuals, per device, or as one norm of all of them
    where the transforms' per-device norms are placed over different mesh
    axes), or None if there is none. With
    ``by_path=True``: ``{path string: CompressionStats}``, in tree order.
  """
  found = []
  # compressed_mean's states, and any other transform's that carries
  # CompressionStats (jaxcomp.demo's).
  has_stats = lambda x: isinstance(x, tuple) and isinstance(
      getattr(x, "stats", None), CompressionStats)

  def visit(path, x):
    if has_stats(x):
      found.append((jax.tree_util.keystr(path), x.stats))
    return None

  jax.tree_util.tree_map_with_path(visit, state, is_leaf=has_stats)
  if by_path:
    return dict(found)
  if not found:
    return None
  if len(found) == 1:
    return found[0][1]
  total = lambda f: sum(getattr(s, f) for _, s in found)
  norms = [s.residual_norm for _, s in found]
  try:
    residual = jnp.sqrt(sum(r ** 2 for r in norms))
  except Exception:  # pylint: disable=broad-except
    # Per-device norms placed over different axes (HSDP's transforms over
    # devices and over hosts) do not line up device by device: one norm of
    # every residual.
    residual = jnp.sqrt(sum(jnp.sum(r ** 2) for r in norms))
  sent, dense = total("bytes_sent"), total("dense_bytes")
  on_wire, dense_wire = total("wire_bytes"), total("dense_wire_bytes")
  return CompressionStats(
      bytes_sent=sent, dense_bytes=dense,
      compression_factor=dense / jnp.maximum(sent, 1.0),
      wire_bytes=on_wire, dense_wire_bytes=dense_wire,
      wire_compression_factor=jnp.where(
          on_wire > 0, dense_wire / jnp.maximum(on_wire, 1.0), 1.0),
      residual_norm=residual,
      skipped_steps=total("skipped_steps"), state_bytes=total("state_bytes"))
