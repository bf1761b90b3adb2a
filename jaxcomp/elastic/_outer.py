"""The elastic islands' outer sync in JAX, on lowcomm's and feedback's
pieces: no torch here, so a test can run it beside :func:`jaxcomp.diloco`.

Every parameter leaf is flattened into one buffer (one bucket, as
``compressed_mean(bucketing="whole")``), and per sync:

1. the pseudo-gradient ``anchor - local`` leaf by leaf in each leaf's dtype
   (:func:`jaxcomp.lowcomm.pseudo_gradient`), concatenated as float32
   ``(n,)`` (:func:`jaxcomp._parts.concat`);
2. the error feedback of :mod:`jaxcomp.feedback` (residual: ``v = pseudo +
   residual``, then ``residual = v - decode(encode(v))``; none: ``v =
   pseudo``), the buffer travelling in its leaves' common dtype (float32
   where they differ), as a bucket of ``compressed_mean`` does;
3. the islands' payloads, gathered by torchft, decoded and summed by the
   compressor's ``decode_sum`` in rank order and divided by the island
   count (what the ``"allgather"`` collective computes on a mesh);
4. the mean cut back into leaves (:func:`jaxcomp._parts.split`, each in its
   leaf's shape and dtype) and the outer step
   (:func:`jaxcomp.lowcomm.outer_step`).

So on the same pseudo-gradients, compressor and outer optimizer, the islands
reach :func:`jaxcomp.diloco`'s anchor (``tests/test_elastic_numerics.py``).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxcomp import _parts
from jaxcomp import compressors
from jaxcomp import feedback as feedback_lib
from jaxcomp import lowcomm


@dataclasses.dataclass(frozen=True)
class BufferPlan:
  """The flat buffers of one island's sync: where each parameter sits in
  the pseudo-gradient buffer, and each of the compressor's payload arrays
  in the bytes sent.

  Attributes:
    treedef: the parameters' tree structure.
    shapes: each parameter leaf's shape, in ``jax.tree.leaves`` order.
    dtypes: each parameter leaf's dtype.
    n: parameter elements, the pseudo-gradient buffer's length.
    dtype: the dtype the buffer is encoded in: the leaves' common dtype,
      float32 where they differ.
    payload: the compressor's arrays for an ``n``-element buffer.
    payload_treedef: their tree structure.
  """

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  n: int
  dtype: Any
  payload: tuple[jax.ShapeDtypeStruct, ...]
  payload_treedef: Any

  @property
  def sizes(self) -> tuple[int, ...]:
    """Each parameter leaf's element count."""
    return tuple(math.prod(s) for s in self.shapes)

  @property
  def payload_bytes(self) -> int:
    """Bytes of one island's payload."""
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in self.payload)


def plan_buffer(anchor, comp: compressors.Compressor,
                key: jax.Array) -> BufferPlan:
  """The :class:`BufferPlan` of parameters like ``anchor`` under ``comp``.

  Raises:
    ValueError: what ``comp.check_size`` raises for the buffer's length.
  """
  leaves, treedef = jax.tree.flatten(anchor)
  n = sum(int(np.prod(np.shape(x))) for x in leaves)
  comp.check_size(n)
  dtypes = tuple(jnp.dtype(jnp.result_type(x)) for x in leaves)
  dtype = dtypes[0] if len(set(dtypes)) == 1 else jnp.dtype(jnp.float32)
  out = jax.eval_shape(lambda v, k: comp.encode(v, k),
                       jax.ShapeDtypeStruct((n,), dtype), key)
  p_leaves, p_treedef = jax.tree.flatten(out)
  return BufferPlan(treedef=treedef,
                    shapes=tuple(tuple(np.shape(x)) for x in leaves),
                    dtypes=dtypes, n=n, dtype=dtype,
                    payload=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype)
                                  for s in p_leaves),
                    payload_treedef=p_treedef)


def feedback_for(error_feedback: bool) -> feedback_lib.Feedback:
  """The islands' feedback: residual (EF-SGD) or none."""
  return feedback_lib.get(bool(error_feedback), biased=True)


def encode(plan: BufferPlan, comp: compressors.Compressor,
           fb: feedback_lib.Feedback, anchor, local, residual: jax.Array,
           key: jax.Array) -> tuple[list, jax.Array]:
  """This island's payload for ``anchor - local``, and its new residual.

  Args:
    plan: the buffers' plan.
    comp: the compressor.
    fb: the feedback (:func:`feedback_for`).
    anchor: the synchronized parameters.
    local: this island's parameters after the interval.
    residual: float32 ``(n,)``, what this island has not sent yet (zeros
      without feedback).
    key: this island's key for the step.

  Returns:
    ``(payload, residual)``: the payload's arrays (``jax.tree.leaves``
    order) and the new float32 ``(n,)`` residual (unchanged without
    feedback).
  """
  pseudo = lowcomm.pseudo_gradient(jax.tree.leaves(anchor),
                                   jax.tree.leaves(local))
  x = _parts.concat(tuple(p.reshape(-1).astype(jnp.float32)
                          for p in pseudo))
  state = (residual,) if isinstance(fb, feedback_lib.ResidualFeedback) else ()
  v, ctx = fb.prepare((x,), state)
  payload = comp.encode(v[0].astype(plan.dtype), key)
  sent = comp.decode_parts(payload, (plan.n,), key)
  _, state = fb.finish(ctx, (), sent)
  return jax.tree.leaves(payload), (state[0] if state else residual)


def decode_mean(plan: BufferPlan, comp: compressors.Compressor, payloads,
                key: jax.Array) -> jax.Array:
  """The islands' mean pseudo-gradient, float32 ``(n,)``.

  Args:
    plan: the buffers' plan.
    comp: the compressor.
    payloads: per payload array, the islands' arrays stacked in rank order
      (leading axis: islands).
    key: this island's key for the step.
  """
  islands = payloads[0].shape[0]
  tree = jax.tree.unflatten(plan.payload_treedef, list(payloads))
  return comp.decode_sum(tree, plan.n, key) / islands


def apply_mean(plan: BufferPlan, outer: optax.GradientTransformation,
               anchor, outer_state, mean: jax.Array):
  """The outer step on the mean pseudo-gradient ``mean`` (float32
  ``(n,)``), cut into the parameters' shapes and dtypes. Returns ``(anchor,
  outer_state)``."""
  parts = _parts.split(mean, plan.sizes)
  avg = jax.tree.unflatten(plan.treedef, [
      p.reshape(shape).astype(dtype)
      for p, shape, dtype in zip(parts, plan.shapes, plan.dtypes)])
  return lowcomm.outer_step(outer, anchor, outer_state, avg)


def jitted(plan: BufferPlan, comp: compressors.Compressor,
           fb: feedback_lib.Feedback, outer: optax.GradientTransformation
           ) -> tuple[Callable, Callable, Callable]:
  """:func:`encode`, :func:`decode_mean` and :func:`apply_mean` bound to one
  island's plan, compressor, feedback and outer optimizer, jitted."""
  return (jax.jit(lambda a, x, r, k: encode(plan, comp, fb, a, x, r, k)),
          jax.jit(lambda ps, k: decode_mean(plan, comp, ps, k)),
          jax.jit(lambda a, s, m: apply_mean(plan, outer, a, s, m)))
