"""The bucket loop of :func:`jaxcomp.compressed_mean`'s ``update``: exact
groups and compressed buckets, through the feedback and the collective.

Two siblings share the bucket plan and the loop: :func:`average` gives every
device the whole mean (an all-reduce of compressed payloads), and
:func:`reduce_scatter` each device its shard of the mean (sharded data
parallelism). They differ in how the exact group travels and in the one
call that exchanges a bucket.
"""

from __future__ import annotations

from typing import NamedTuple
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from jaxcomp import _parts
from jaxcomp.collectives import Collective
from jaxcomp.compressors import Compressor
from jaxcomp.feedback import Feedback
from jaxcomp.transform._buckets import BucketPlan
from jaxcomp.transform._nonfinite import Policy


class Components(NamedTuple):
  """The components of one transform's exchange (static): compressor,
  collective, feedback and nonfinite policy."""

  compressor: Compressor
  collective: Collective
  feedback: Feedback
  policy: Policy  # the nonfinite policy


class Exchanged(NamedTuple):
  """What the bucket loop returns."""

  out: list  # per leaf: its float32 flat mean (None for passthrough leaves)
  feedback: tuple  # per bucket: the feedback's new state
  exchange_state: tuple  # per bucket: the collective's new state
  sq_residual: jax.Array  # float32 (): this device's squared residual norm


def _exact_groups(lay: BucketPlan):
  """Per dtype of the exact leaves (in first-seen order): their indices."""
  for dtype in dict.fromkeys(lay.dtypes[i] for i in lay.plan.exact):
    yield dtype, [i for i in lay.plan.exact if lay.dtypes[i] == dtype]


def _loop(components: Components, lay: BucketPlan, flat, any_bad, state, step_key,
          axis_name, exact_mean: Callable, exchange_bucket: Callable
          ) -> Exchanged:
  """The loop both paths share: one exact mean per dtype (in that dtype: a
  bf16 leaf sends bf16), then per bucket the feedback's ``prepare``, the
  exchange, the feedback's ``finish`` and the nonfinite policy."""
  comp, coll, fb, policy = components
  out = [None] * len(flat)
  for dtype, group in _exact_groups(lay):
    mean = exact_mean(tuple(flat[i].astype(dtype) for i in group),
                      [lay.sizes[i] for i in group])
    for i, m in zip(group, mean):
      out[i] = m.astype(jnp.float32)
  new_fb, new_exchange = [], []
  sq_residual = jnp.zeros((), jnp.float32)
  for b, bucket in enumerate(lay.plan.buckets):
    v, ctx = fb.prepare(tuple(flat[i] for i in bucket), state.feedback[b])
    key = coll.device_key(comp, jax.random.fold_in(step_key, b), axis_name)
    # The bucket travels in its gradient's own dtype; the feedback keeps
    # float32, and the rounding to that dtype is part of what it keeps.
    mean, local, estate = exchange_bucket(b, v, lay.bucket_dtypes[b], key)
    mean, fstate = fb.finish(ctx, mean, local)
    if policy.keeps_state:
      # A bad step sends nothing and leaves no trace in the state.
      fstate, estate = jax.tree.map(
          lambda new, old: jnp.where(any_bad, old, new), (fstate, estate),
          (state.feedback[b], state.exchange_state[b]))
    mean = policy.bucket_mean(any_bad, mean)
    new_fb.append(fstate)
    new_exchange.append(estate)
    r = fb.unsent(fstate)
    if r is not None:
      sq_residual = sq_residual + sum(jnp.sum(x * x) for x in r)
    for i, m in zip(bucket, mean):
      out[i] = m
  return Exchanged(out, tuple(new_fb), tuple(new_exchange), sq_residual)


def average(components: Components, lay: BucketPlan, flat, any_bad, state, step_key,
            axis_name) -> Exchanged:
  """Every device gets the whole mean: the exact group by ``lax.pmean``,
  each bucket by ``collective.exchange``."""
  comp, coll = components.compressor, components.collective

  def exact_mean(group, sizes):
    return _parts.split(lax.pmean(_parts.concat(group), axis_name), sizes)

  def exchange_bucket(b, v, dtype, key):
    # A compressor that works in the tensors' shapes is bound to them.
    return coll.exchange(comp.for_shapes(lay.shapes[b]),
                         tuple(x.astype(dtype) for x in v),
                         lay.shapes[b], key=key, step=state.count,
                         axis_name=axis_name, state=state.exchange_state[b])

  return _loop(components, lay, flat, any_bad, state, step_key, axis_name,
               exact_mean, exchange_bucket)


def reduce_scatter(components: Components, lay: BucketPlan, flat, any_bad, state, step_key,
                   axis_name, p: int) -> Exchanged:
  """Each device gets its shard of the mean: every part is laid out
  chunk-major (chunk ``j`` holds every tensor's shard ``j``), the exact
  group goes through ``lax.psum_scatter`` and each bucket through
  ``collective.reduce_scatter_buffer``; ``local`` comes back whole, so the
  feedback runs unchanged. The collective keeps no state here (no second
  phase)."""
  comp, coll = components.compressor, components.collective

  def exact_mean(group, sizes):
    mean = lax.psum_scatter(_parts.chunk_major(group, p).reshape(p, -1),
                            axis_name, scatter_dimension=0) / p
    return _parts.split(mean, [n // p for n in sizes])

  def exchange_bucket(b, v, dtype, key):
    mean, local = coll.reduce_scatter_buffer(
        comp, _parts.chunk_major(v, p).astype(dtype), key, axis_name)
    sizes = lay.bucket_sizes(b)
    return (_parts.split(mean, [n // p for n in sizes]),
            _parts.from_chunk_major(local, sizes, p), ())

  return _loop(components, lay, flat, any_bad, state, step_key, axis_name,
               exact_mean, exchange_bucket)
