"""DeMo, Decoupled Momentum optimization: each device keeps its momentum,
sends only its fast DCT components, and steps by the sign of their average.

DeMo is the four parts of every compressed exchange composed: its DCT top-k
is a compressor (``"dct_topk"``, :class:`jaxcomp.compressors.DCTTopK`), its
all-gather averaged per coefficient over the devices that sent it a
collective (``"sender_mean"``), its decayed momentum the residual error
feedback with a decay (:class:`jaxcomp.feedback.ResidualFeedback`); the
optimizer around :func:`jaxcomp.compressed_mean` scales by the learning rate
before and takes the sign after.

References:
  Peng, Quesnelle & Kingma, DeMo: Decoupled Momentum Optimization
  <https://arxiv.org/abs/2411.19870>, 2024.
"""

from __future__ import annotations

import math
import numbers
from typing import NamedTuple, cast

import jax
import jax.numpy as jnp
import optax

from jaxcomp import _mesh
from jaxcomp import compressors
from jaxcomp import feedback
from jaxcomp import transform
from jaxcomp._mesh import AxisName
from jaxcomp.transform import CompressedMeanState


class DeMoState(NamedTuple):
  """State of :func:`demo`."""

  count: jax.Array  # shape=(), int32, steps taken
  exchange: CompressedMeanState  # the compressed mean's: the
  #   momentum not yet sent is its residual (float32, per device, per
  #   tensor: demo_momentum reads it); its stats are what get_stats reads


def demo(learning_rate, *, compression_decay: float = 0.999,
         compression_topk: int = 32, compression_chunk: int = 64,
         weight_decay: float = 0.0,
         axis_name: AxisName = "data") -> optax.GradientTransformation:
  """DeMo, Decoupled Momentum optimization (Peng, Quesnelle & Kingma 2024):
  each device keeps its momentum, sends only its fast components, and steps
  by the sign of their average. A whole optimizer (no optimizer after it).

  Per device and tensor, inside ``jax.shard_map`` over ``axis_name``, with
  this device's own gradient ``g`` (the reference implementation's steps,
  ``bloc97/DeMo``'s ``demo.py``):

  1. ``delta = compression_decay * delta + lr * g`` (float32, per device:
     residual error feedback with a decay);
  2. the tensor, viewed as ``(rows, cols)`` (a vector as one row; more axes
     folded into ``cols``), is cut into chunks of ``h x w``, ``h`` and ``w``
     the largest divisors of ``rows`` and ``cols`` not above
     ``compression_chunk``, and each chunk is DCT-II transformed (2-D,
     orthonormal);
  3. each chunk keeps its ``compression_topk`` largest coefficients by
     magnitude (values float32, indices int32; the ``"dct_topk"``
     compressor);
  4. what they represent is subtracted from ``delta`` (the momentum not
     sent stays local: the residual);
  5. one all-gather per tensor of the values and indices; each coefficient
     is the mean over the devices that sent it (0 where none did), inverse
     DCT (the ``"sender_mean"`` collective);
  6. update ``-lr * sign(that) - lr * weight_decay * params``.

  This is ``jaxcomp.compressed_mean("dct_topk", axis_name,
  collective="sender_mean", error_feedback=ResidualFeedback(decay=...))``
  between the learning-rate scaling and the sign, so its DCT top-k serves
  any other exchange too (DiLoCo's pseudo-gradients, say).

  Bytes per device per step: ``8 * compression_topk`` per chunk (a 64 x 64
  chunk of float32 is 16,384 bytes: 64x fewer at the defaults), moved by
  all-gather.

  Args:
    learning_rate: a float or an ``optax`` schedule of the step count.
    compression_decay: the momentum's decay, in ``[0, 1)``.
    compression_topk: coefficients kept per chunk, >= 1.
    compression_chunk: the chunk size target per axis, >= 1.
    weight_decay: decoupled weight decay (needs ``params`` in ``update``).
    axis_name: the data-parallel axis.

  Returns:
    A ``GradientTransformation`` whose state is :class:`DeMoState`.

  Raises:
    ValueError: a hyperparameter out of range (named), at construction.

  Example:
    One step on a 16 x 16 tensor in four 8 x 8 chunks, 4 coefficients
    sent per chunk:

    >>> import jax, jax.numpy as jnp, jaxcomp
    >>> from jax.sharding import NamedSharding, PartitionSpec as P
    >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
    >>> tx = jaxcomp.demo(1e-3, compression_topk=4, compression_chunk=8)
    >>> state = jaxcomp.init(tx, {"w": jnp.zeros((16, 16))}, mesh)
    >>> def loss_fn(params, x):
    ...   return jnp.mean((x @ params["w"] - 1.0) ** 2)
    >>> step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh)
    >>> x = jax.device_put(jnp.ones((jax.device_count(), 16)),
    ...                    NamedSharding(mesh, P("data")))
    >>> state, loss = step(state, x)
    >>> stats = jaxcomp.get_stats(state.opt_state)
    >>> float(stats.bytes_sent), float(stats.dense_bytes)  # 4 x 4 x 8 bytes
    (128.0, 1024.0)
    >>> jnp.unique(state.params["w"])  # a sign step: every entry moves by lr
    Array([0.001], dtype=float32)

  References:
    Peng, Quesnelle & Kingma, DeMo: Decoupled Momentum Optimization
    <https://arxiv.org/abs/2411.19870>, 2024; reference implementation
    https://github.com/bloc97/DeMo (``demo.py``; defaults from its OLMo
    configurations: decay 0.999, top-k 32, chunk 64).
  """
  if not (isinstance(compression_decay, (int, float))
          and 0 <= compression_decay < 1):
    raise ValueError(f"compression_decay must be in [0, 1), got {compression_decay!r}")
  for name, v in (("compression_topk", compression_topk),
                  ("compression_chunk", compression_chunk)):
    if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
      raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
  if not (isinstance(weight_decay, (int, float)) and math.isfinite(weight_decay)
          and weight_decay >= 0):
    raise ValueError(f"weight_decay must be a finite number >= 0, got {weight_decay!r}")
  _mesh.check_axis_name(axis_name)
  lr_fn = learning_rate if callable(learning_rate) else (lambda _: learning_rate)
  mean = transform.compressed_mean(
      compressors.DCTTopK(topk=compression_topk, chunk=compression_chunk),
      axis_name, collective="sender_mean",
      error_feedback=feedback.ResidualFeedback(decay=float(compression_decay)))

  def scaled(grads, lr):
    return jax.tree.map(lambda g: lr * g.astype(jnp.float32), grads)

  def init_fn(params):
    _mesh.check_bound(axis_name, "demo.init")
    return DeMoState(count=jnp.zeros((), jnp.int32),
                     exchange=cast(CompressedMeanState, mean.init(jax.tree.map(
                         lambda p: jnp.zeros(jnp.shape(p), jnp.float32),
                         params))))

  def update_fn(updates, state, params=None):
    if weight_decay and params is None:
      raise ValueError("demo(weight_decay=...) needs params in update")
    lr = jnp.asarray(lr_fn(state.count), jnp.float32)
    avg, exchange = mean.update(scaled(updates, lr), state.exchange)
    exchange = cast(CompressedMeanState, exchange)
    ps = updates if params is None else params

    def one(m, g, p):
      update = -lr * jnp.sign(m)
      if weight_decay:
        update = update - lr * jnp.float32(weight_decay) * p.astype(jnp.float32)
      return update.astype(jnp.result_type(g))

    return (jax.tree.map(one, avg, updates, ps),
            DeMoState(count=state.count + 1, exchange=exchange))

  # optax types a state as an array tree; DeMoState also holds the compressed
  # mean's static configuration.
  return optax.GradientTransformation(
      init_fn, update_fn)  # pyright: ignore[reportArgumentType]


def demo_momentum(state: DeMoState, params):
  """The momentum each device has not sent yet (DeMo's ``delta``), shaped
  like ``params``: float32, per device (a global state's leaves carry the
  leading device axis, a per-device state's do not)."""
  leaves, treedef = jax.tree.flatten(params)
  parts = [b[0] for b in state.exchange.feedback]  # one tensor per bucket
  return jax.tree.unflatten(treedef, [
      x.reshape(x.shape[:-1] + jnp.shape(p)) for x, p in zip(parts, leaves)])


def demo_bytes(params, *, compression_topk: int = 32,
               compression_chunk: int = 64) -> int:
  """Bytes one device hands to :func:`demo`'s all-gathers per step for
  ``params`` (values float32 and indices int32, ``compression_topk`` per
  chunk of each tensor's DCT)."""
  comp = compressors.DCTTopK(topk=compression_topk, chunk=compression_chunk)
  return sum(comp.for_shapes((jnp.shape(p),)).payload_bytes(int(jnp.size(p)))
             for p in jax.tree.leaves(params))
