"""How one gradient's leaves are cut into buckets, and the checks on the
gradient and the state that :func:`jaxcomp.compressed_mean` runs before any
exchange (all static: shapes, dtypes, types)."""

from __future__ import annotations

import math
import warnings
from typing import NamedTuple
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from jaxcomp import _mesh
from jaxcomp import bucketing as bucketing_lib
from jaxcomp import wire
from jaxcomp.collectives import chunk_size


class BucketPlan(NamedTuple):
  """How one gradient's leaves are cut into buckets (static)."""

  sizes: list  # elements per leaf (shards: p * c, the padded whole size)
  dtypes: list  # per leaf: its dtype
  plan: bucketing_lib.BucketPlan  # exact: averaged by one pmean per dtype
  shapes: list  # per bucket: the shapes of its tensors
  bucket_dtypes: list  # per bucket: the dtype it travels in (its leaves'
  #                      common dtype, float32 where they differ)
  passthrough: tuple  # leaves left out by the mask that are not floating:
  #                     their update is zero

  def bucket_sizes(self, b: int) -> list[int]:
    return [self.sizes[i] for i in self.plan.buckets[b]]

  def key(self) -> tuple:
    """Everything the bucket plan fixes, hashable: equal keys, equal plans."""
    return (tuple(self.sizes), tuple(self.dtypes), self.plan,
            tuple(self.shapes), tuple(self.bucket_dtypes), self.passthrough)


class Bucketing(NamedTuple):
  """``compressed_mean``'s bucketing arguments (validated at construction)."""

  strategy: str
  min_size: int
  bucket_elements: int | None
  bucket_bytes: int | None
  plan: Sequence[Sequence[int]] | None
  mask: object


def leaf_flags(tree, mask) -> list[bool]:
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


def _check_flat_shards(tree, what: str) -> None:
  bad = [jax.tree_util.keystr(path) for path, x in
         jax.tree_util.tree_flatten_with_path(tree)[0] if jnp.ndim(x) != 1]
  if bad:
    raise ValueError(
        f"compressed_mean(output='shard').init takes flat parameter shards "
        f"(one 1-D array per leaf, as jaxcomp.fsdp.shard_params makes them); "
        f"the {what} leaves {', '.join(bad[:3])} are not 1-D")


def _kind(x, axis_name) -> tuple:
  """What a merged bucket keeps apart (``bucketing="auto"``): the leaf's
  dtype, and the mesh axes it varies over besides the averaging axes (a
  tensor-parallel shard varies over ``"model"``; merged with a replicated
  leaf, both would come out varying over it)."""
  names = set(_mesh.axes(axis_name)) if axis_name is not None else set()
  return (jnp.dtype(jnp.result_type(x)),
          tuple(sorted(_mesh.varying_axes(x) - names)))


def plan(tree, bucketing: Bucketing, what: str, *, shard_axis=None,
           shards: bool = False, axis_name=None,
           made: bucketing_lib.BucketPlan | None = None) -> BucketPlan:
  """The bucket plan of ``tree``'s leaves.

  Args:
    tree: the gradient (or, in ``init``, the parameters).
    bucketing: the bucketing arguments.
    what: ``"gradient"`` or ``"params"``, for error messages.
    shard_axis: ``output="shard"``: the axes of the reduce-scatter (inside
      shard_map); every leaf is then cut into ``p`` chunks of ``c =
      ceil(n / p)`` elements (zero-padded), its size ``p * c``.
    shards: ``tree`` holds flat parameter shards (``output="shard"``'s
      ``init``), not tensors of the whole shapes.
    axis_name: the averaging axes (``bucketing="auto"`` keeps leaves that
      vary over other axes apart).
    made: the plan ``init`` made for ``"auto"`` (carried in the state), used
      as it is so that an update traced where values carry no device types
      cuts the gradient as ``init`` did.

  Raises:
    TypeError: a leaf that is not floating and not left out by the mask.
    ValueError: a mask that does not fit; shards that are not 1-D.
  """
  leaves = jax.tree.leaves(tree)
  flags = leaf_flags(tree, bucketing.mask)
  _check_floating(leaves, flags, what)
  sizes = [math.prod(jnp.shape(x)) for x in leaves]
  if shard_axis is not None:
    p = wire.devices(_mesh.axis_sizes(shard_axis))
    if shards:
      _check_flat_shards(tree, what)
      sizes = [p * n for n in sizes]
    else:
      sizes = [p * chunk_size(n, p) for n in sizes]
  passthrough = tuple(
      i for i, x in enumerate(leaves)
      if not jnp.issubdtype(jnp.result_type(x), jnp.floating))
  # Leaves the mask leaves out are planned as empty, which sends them to
  # the exact group (and out of an explicit plan); so does a bucket of
  # zero-size leaves only (an explicit plan may name one), which has
  # nothing to compress.
  n_leaves = len(leaves)
  if made is not None and sorted(
      [*made.exact, *passthrough, *(i for b in made.buckets for i in b)]
  ) == list(range(n_leaves)):
    bplan = made
  else:
    bplan = _plan(sizes, flags, leaves, bucketing, axis_name)
  buckets = tuple(b for b in (tuple(i for i in b if flags[i])
                              for b in bplan.buckets)
                  if any(sizes[i] for i in b))
  exact = tuple(sorted(set(range(n_leaves)) - set(passthrough)
                       - {i for b in buckets for i in b}))
  shapes = [tuple((sizes[i],) if shard_axis is not None
                  else tuple(jnp.shape(leaves[i])) for i in b)
            for b in buckets]
  dtypes = [jnp.dtype(jnp.result_type(x)) for x in leaves]
  bucket_dtypes = [dtypes[b[0]] if len({dtypes[i] for i in b}) == 1
                   else jnp.dtype(jnp.float32) for b in buckets]
  return BucketPlan(sizes, dtypes, bucketing_lib.BucketPlan(exact, buckets),
                shapes, bucket_dtypes, passthrough)


def _plan(sizes, flags, leaves, bucketing: Bucketing,
          axis_name) -> bucketing_lib.BucketPlan:
  """The bucket plan of leaves of ``sizes`` (``flags``: the mask's)."""
  return bucketing_lib.plan_buckets(
      [n if f else 0 for n, f in zip(sizes, flags)],
      strategy=bucketing.strategy, min_size=bucketing.min_size,
      bucket_elements=bucketing.bucket_elements,
      bucket_bytes=bucketing.bucket_bytes, plan=bucketing.plan,
      kinds=[_kind(x, axis_name) for x in leaves])


def check_per_device(tree, axis_name) -> None:
  """Raises TypeError when a gradient leaf is typed invariant over
  ``axis_name``: JAX already summed it over the devices (plain ``jax.grad``
  inside ``shard_map`` w.r.t. replicated parameters), so compressing it would
  save nothing and the mean would come out ``p`` times too large."""
  if not _mesh.types_track_devices(axis_name):
    if _mesh.axis_size(axis_name) == 1:
      # One device (JAX drops size-1 axes from types under
      # jax_remove_size_one_mesh_axis_from_type): a sum over it is the value.
      return
    # pmap (or shard_map with check_vma=False) types no value by device, so
    # a gradient already averaged looks like a per-device one.
    warnings.warn(
        "compressed_mean runs where values carry no per-device types "
        "(jax.pmap, or shard_map with check_vma=False), so it cannot tell "
        "each device's own gradient from one already averaged: make sure no "
        "lax.pmean / psum of the gradient comes before it (that sends the "
        "gradient twice, dense and compressed). Under jax.shard_map with "
        "check_vma on, jaxcomp checks this", _mesh.PerDeviceUnchecked,
        stacklevel=4)
    return
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
          "jax.grad of the parameters after jaxcomp.placement.to_varying) so that "
          "each device compresses its own gradient.")


def check_state(state, expected) -> None:
  """Raises ValueError naming the first leaf where ``state`` differs in
  structure, shape or dtype from ``expected`` (the state ``init`` would make
  for this gradient). The configuration (static data) may differ: a state
  passes from one transform to another of the same shapes (a warm-up
  stage's to the next)."""
  got = jax.tree_util.tree_flatten_with_path(state)
  want = jax.tree_util.tree_flatten_with_path(expected)
  made_for = _made_for(state, expected)
  if got[1] != want[1]:
    got_paths = [jax.tree_util.keystr(p) for p, _ in got[0]]
    want_paths = [jax.tree_util.keystr(p) for p, _ in want[0]]
    first = next(((g, w) for g, w in zip(got_paths + ["(end)"],
                                         want_paths + ["(end)"]) if g != w),
                 None)
    where = ("its leaves' containers differ" if first is None else
             f"its structure differs first at {first[0]} where {first[1]} "
             "was expected")
    raise ValueError(
        f"compressed_mean.update: the state does not fit this transform: "
        f"{where} ({len(got_paths)} leaves given, {len(want_paths)} "
        f"expected).{made_for} Initialise the state (jaxcomp.init) with this "
        "transform and parameters of the same structure and shapes as the "
        "gradients.")
  for (path, g), (_, w) in zip(got[0], want[0]):
    if jnp.shape(g) != w.shape or jnp.result_type(g) != w.dtype:
      raise ValueError(
          f"compressed_mean.update: the state leaf "
          f"{jax.tree_util.keystr(path)} has shape {jnp.shape(g)} and dtype "
          f"{jnp.result_type(g)}, but this gradient needs {w.shape} "
          f"{w.dtype}: the state was made for another model, bucketing or "
          f"compressor.{made_for} Initialise it (jaxcomp.init) with this "
          "transform and parameters of the same structure and shapes as the "
          "gradients.")


# The parts of a configuration whose change makes a state of other contents.
_STATE_MAKERS = ("compressor", "collective", "error_feedback", "bucketing",
                 "output")


def _made_for(state, expected) -> str:
  """`` The state was made for ...``: the parts of the configuration in
  which the transform that made ``state`` differs from this one, or ``""``
  where they agree (or either state carries none)."""
  try:
    have, want = state.config.as_dict(), expected.config.as_dict()
  except AttributeError:
    return ""
  diffs = [f"{k} {have.get(k)!r} where this transform has {want.get(k)!r}"
           for k in _STATE_MAKERS if have.get(k) != want.get(k)]
  return (" The state was made for " + "; ".join(diffs) + ".") if diffs else ""
