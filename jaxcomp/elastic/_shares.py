"""Shares and shards: what each JAX process of an island sends at the
outer sync. No torch here.

An island of ``M`` processes runs one torchft manager per process, and
process ``r``'s process group joins process ``r`` of the other islands
(torchft's group ranks). Each process sends only its *share* of the
pseudo-gradient, not the whole of it:

* every parameter leaf has, on each process, a *held* block: what that
  process's devices hold of it (the whole leaf for a leaf replicated over
  the island, or given as host values; the process's rows for a leaf
  sharded over the island's processes, FSDP);
* the processes holding the same block split its elements (flattened in C
  order) into contiguous parts, one per holder in process order: a leaf
  replicated over ``M`` processes is cut in ``M`` parts, a block held by one
  process is that process's whole;
* a process's share is its parts of every leaf, concatenated in leaf
  order (float32, ``n / M`` elements for ``M`` processes holding the whole
  model): it is encoded, with its own error-feedback residual, and
  all-gathered with the same share of the other islands;
* the mean of each share is then needed wherever the block is held: when
  some block has several holders, the island gathers its processes' mean
  shares over its own links (a JAX all-gather, :func:`gather`); when every
  block has one holder (FSDP over the island's processes), nothing is
  gathered and each process steps its own block.

So a sharded (FSDP) island never gathers its parameters, and process ``r``
exchanges the same elements on every island (the islands must hold their
parameters alike: the same process count and shardings). With ``M = 1``
the share is the whole buffer of :mod:`jaxcomp.elastic._outer`.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import optax

from jaxcomp import compressors
from jaxcomp import feedback as feedback_lib
from jaxcomp.elastic import _outer

Box = tuple[tuple[int, int], ...]  # per axis (start, stop)


@dataclasses.dataclass(frozen=True)
class LeafShare:
  """One leaf on one process.

  Attributes:
    box: the held block, per axis ``(start, stop)`` in the global leaf.
    holders: the processes holding the same block, in process order.
    start: first element of this process's part, in the block flattened.
    stop: one past its last element.
  """

  box: Box
  holders: tuple[int, ...]
  start: int
  stop: int

  @property
  def held_shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in self.box)

  @property
  def size(self) -> int:
    """Elements of this process's part."""
    return self.stop - self.start


@dataclasses.dataclass(frozen=True)
class ShareLayout:
  """Every process's :class:`LeafShare` of every leaf.

  Attributes:
    index: this process's index in the island (``jax.process_index()``).
    shapes: each leaf's global shape.
    leaves: ``leaves[p][l]``, process ``p``'s share of leaf ``l``.
    shardings: each leaf's sharding when given as a global array sharded
      over the island's processes, else None.
  """

  index: int
  shapes: tuple[tuple[int, ...], ...]
  leaves: tuple[tuple[LeafShare, ...], ...]
  shardings: tuple[jax.sharding.Sharding | None, ...]

  @property
  def processes(self) -> int:
    return len(self.leaves)

  @property
  def mine(self) -> tuple[LeafShare, ...]:
    return self.leaves[self.index]

  def share_size(self, p: int | None = None) -> int:
    """Elements of process ``p``'s share (default: this process's)."""
    return sum(s.size for s in self.leaves[self.index if p is None else p])

  @property
  def needs_gather(self) -> bool:
    """Whether some process holds elements that another one sends."""
    return any(len(s.holders) > 1 for s in self.mine)

  @property
  def sharded(self) -> bool:
    """Whether some leaf is held in part (FSDP)."""
    return any(s.held_shape != shape for s, shape in zip(self.mine,
                                                         self.shapes))

  def describe(self) -> list:
    """This process's share, JSON-able: per leaf its box and part."""
    return [[list(map(list, s.box)), s.start, s.stop] for s in self.mine]


def _parts(size: int, holders: int) -> list[int]:
  return [size * k // holders for k in range(holders + 1)]


def _box_of(indices: Sequence[tuple[slice, ...]], shape) -> Box:
  """The block a process's devices hold, checked to be one rectangle."""
  norm = {tuple(sl.indices(n)[:2] for sl, n in zip(idx, shape))
          for idx in indices}
  box = tuple((min(b[a][0] for b in norm), max(b[a][1] for b in norm))
              for a in range(len(shape)))
  volume = sum(math.prod(b - a for a, b in blk) for blk in norm)
  if volume != math.prod(b - a for a, b in box):
    raise ValueError(
        "each process of an island must hold one rectangular block of a "
        f"sharded leaf; its devices hold {sorted(norm)} of shape {shape}")
  return box


def _leaf_boxes(x, processes: int) -> tuple[list[Box], Box]:
  """Each process's held block of leaf ``x``, and the whole leaf's box."""
  shape = tuple(np.shape(x))
  whole = tuple((0, n) for n in shape)
  if not (isinstance(x, jax.Array) and not x.is_fully_addressable):
    return [whole] * processes, whole
  by_process: dict[int, list] = {}
  for d, idx in x.sharding.devices_indices_map(shape).items():
    by_process.setdefault(d.process_index, []).append(idx)
  return [_box_of(by_process[p], shape) for p in range(processes)], whole


def layout_of(boxes: Sequence[Sequence[Box]], shapes, index: int,
              shardings=None) -> ShareLayout:
  """The :class:`ShareLayout` of held blocks ``boxes[l][p]`` (leaf ``l``,
  process ``p``) of leaves of global ``shapes``, for process ``index``.

  Raises:
    ValueError: two processes' blocks of a leaf overlap without being
      equal.
  """
  processes = len(boxes[0]) if boxes else 1
  per_process: list[list[LeafShare]] = [[] for _ in range(processes)]
  for l_boxes in boxes:
    for p, box in enumerate(l_boxes):
      holders = tuple(q for q, b in enumerate(l_boxes) if b == box)
      for q, b in enumerate(l_boxes):
        overlap = all(max(x[0], y[0]) < min(x[1], y[1])
                      for x, y in zip(box, b))
        if b != box and overlap:
          raise ValueError(f"processes {p} and {q} hold overlapping, "
                           f"unequal blocks {box} and {b} of a leaf")
      bounds = _parts(math.prod(b - a for a, b in box), len(holders))
      j = holders.index(p)
      per_process[p].append(LeafShare(box, holders, bounds[j],
                                      bounds[j + 1]))
  shardings = tuple(shardings) if shardings else (None,) * len(boxes)
  return ShareLayout(index=index, shapes=tuple(map(tuple, shapes)),
                     leaves=tuple(map(tuple, per_process)),
                     shardings=shardings)


def layout(params) -> ShareLayout:
  """The :class:`ShareLayout` of ``params`` on this process: a leaf given
  as a global ``jax.Array`` sharded over the island's processes is held in
  blocks; host values and replicated arrays are held whole.

  Raises:
    ValueError: a process's devices hold more than one rectangle of a
      leaf, or processes hold overlapping, unequal blocks.
  """
  leaves = jax.tree.leaves(params)
  processes = jax.process_count()
  boxes, shardings = [], []
  for x in leaves:
    b, whole = _leaf_boxes(x, processes)
    boxes.append(b)
    shardings.append(None if all(bb == whole for bb in b) else x.sharding)
  return layout_of(boxes, [np.shape(x) for x in leaves], jax.process_index(),
                   shardings)


def held(lay: ShareLayout, tree):
  """``tree`` with each leaf cut to this process's held block (host-local
  arrays)."""
  out = []
  leaves, treedef = jax.tree.flatten(tree)
  for x, s in zip(leaves, lay.mine):
    if isinstance(x, jax.Array) and not x.is_fully_addressable:
      if x.sharding.is_fully_replicated:
        out.append(x.addressable_data(0))
        continue
      buf = np.empty(s.held_shape, x.dtype)
      for shard in x.addressable_shards:
        idx = tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(
            (sl.indices(n)[:2] for sl, n in zip(shard.index, x.shape)),
            s.box))
        buf[idx] = np.asarray(shard.data)
      out.append(jnp.asarray(buf))
    else:
      out.append(jnp.asarray(x))
  return jax.tree.unflatten(treedef, out)


def to_params(lay: ShareLayout, tree):
  """The parameters as the caller gave them, from ``tree``'s held blocks:
  sharded leaves as global arrays of their sharding, the others as the
  held host-local arrays."""
  if not lay.sharded:
    return tree
  leaves, treedef = jax.tree.flatten(tree)
  out = []
  for x, s, shape, sharding in zip(leaves, lay.mine, lay.shapes,
                                   lay.shardings):
    if sharding is None:
      out.append(x)
      continue
    host = np.asarray(x)

    def block(index, host=host, s=s, shape=shape):
      return host[tuple(slice(a - lo, b - lo) for (a, b), (lo, _) in zip(
          (sl.indices(n)[:2] for sl, n in zip(index, shape)), s.box))]
    out.append(jax.make_array_from_callback(shape, sharding, block))
  return jax.tree.unflatten(treedef, out)


def owned(lay: ShareLayout, tree, p: int | None = None) -> list:
  """Process ``p``'s part (default: this process's) of each held leaf of
  ``tree``, flat."""
  return [jnp.ravel(x)[s.start:s.stop]
          for x, s in zip(jax.tree.leaves(tree), lay.leaves[lay.index if p is None else p])]


def _offsets(lay: ShareLayout, p: int) -> list[int]:
  return [0, *np.cumsum([s.size for s in lay.leaves[p]]).tolist()]


def assemble(lay: ShareLayout, shares: Sequence[np.ndarray]) -> np.ndarray:
  """This process's held blocks, flat and concatenated in leaf order, from
  every process's share (``shares[p]``, float32 ``(share_size(p),)``)."""
  offs = [_offsets(lay, p) for p in range(lay.processes)]
  parts = []
  for l, s in enumerate(lay.mine):
    for q in s.holders:
      t = lay.leaves[q][l]
      parts.append(np.asarray(shares[q])[offs[q][l]:offs[q][l] + t.size])
  return np.concatenate(parts) if parts else np.zeros((0,), np.float32)


def gather(lay: ShareLayout, mine, ok: bool) -> tuple[list[np.ndarray], bool]:
  """Every process's share of the island (a JAX all-gather over its
  processes; every process must call it), and whether every process's
  exchange succeeded (``ok``; a failed process passes any ``mine``).

  Returns:
    ``(shares, all_ok)``: ``shares[p]`` float32 ``(share_size(p),)``.
  """
  width = max(lay.share_size(p) for p in range(lay.processes))
  buf = np.zeros((width + 1,), np.float32)
  if ok:
    mine = np.asarray(mine, np.float32)
    buf[:mine.size] = mine
    buf[width] = 1.0
  got = np.asarray(multihost_utils.process_allgather(buf))
  shares = [got[p, :lay.share_size(p)] for p in range(lay.processes)]
  return shares, bool(np.all(got[:, width] == 1.0))


def island_mean(lay: ShareLayout, mean, failure: BaseException | None,
                island: str) -> tuple[jax.Array, int]:
  """The islands' mean over this process's held blocks (float32, flat):
  its own share's when it holds nothing another process sends, else
  gathered from the island's processes (every process joins, a failed one
  too, so that none waits for it). Returns it and the bytes gathered.

  Raises:
    BaseException: ``failure`` (this process's exchange failed), or
      RuntimeError when another process of the island failed its exchange.
  """
  if not lay.needs_gather:
    if failure is not None:
      raise failure
    return mean, 0
  shares, all_ok = gather(lay, mean, failure is None)
  if failure is not None:
    raise failure
  if not all_ok:
    raise RuntimeError(f"island {island!r}: another process of the island "
                       "failed its exchange")
  return jnp.asarray(assemble(lay, shares)), 4 * sum(x.size for x in shares)


def whole_residual(lay: ShareLayout, shares: Sequence[np.ndarray]
                   ) -> np.ndarray:
  """The whole buffer's residual (leaves' elements in order, float32
  ``(n,)``) from every process's share of it, for an island holding every
  leaf whole (not sharded)."""
  offs = [_offsets(lay, p) for p in range(lay.processes)]
  parts = []
  for l in range(len(lay.shapes)):
    for q in lay.mine[l].holders:
      t = lay.leaves[q][l]
      parts.append(np.asarray(shares[q])[offs[q][l]:offs[q][l] + t.size])
  return np.concatenate(parts) if parts else np.zeros((0,), np.float32)


def own_residual(lay: ShareLayout, whole: np.ndarray) -> np.ndarray:
  """This process's share of a whole-buffer residual (the inverse of
  :func:`whole_residual` for this process)."""
  sizes = [math.prod(s) for s in lay.shapes]
  starts = [0, *np.cumsum(sizes).tolist()]
  return np.concatenate([np.asarray(whole)[starts[l] + s.start:
                                           starts[l] + s.stop]
                         for l, s in enumerate(lay.mine)] or
                        [np.zeros((0,), np.float32)])


def plans(lay: ShareLayout, held_anchor, comp: compressors.Compressor,
          key: jax.Array) -> tuple[_outer.BufferPlan, _outer.BufferPlan]:
  """The share's buffer plan (what this process encodes and sends) and the
  held blocks' (where the mean lands for the outer step)."""
  parts = [np.empty((s.size,), jnp.result_type(x))
           for x, s in zip(jax.tree.leaves(held_anchor), lay.mine)]
  return (_outer.plan_buffer(parts, comp, key),
          _outer.plan_buffer(held_anchor, comp, key))


def jitted(lay: ShareLayout, share_plan: _outer.BufferPlan,
           held_plan: _outer.BufferPlan, comp: compressors.Compressor,
           fb: feedback_lib.Feedback, outer: optax.GradientTransformation
           ) -> tuple[Callable, Callable, Callable]:
  """The sync's three jitted steps on this process's share: encode the
  share of ``anchor - local`` (held leaves in, payload and the share's new
  residual out), the islands' mean of the share, and the outer step on the
  held blocks (their mean, flat, in)."""
  enc = jax.jit(lambda a, x, r, k: _outer.encode(
      share_plan, comp, fb, owned(lay, a), owned(lay, x), r, k))
  dec = jax.jit(lambda ps, k: _outer.decode_mean(share_plan, comp, ps, k))
  app = jax.jit(lambda a, s, m: _outer.apply_mean(held_plan, outer, a, s, m))
  return enc, dec, app
