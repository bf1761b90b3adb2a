"""Elastic DiLoCo islands: each island its own JAX job, the outer sync
through torchft, so that losing an island does not stop the others.

An *island* is one JAX job (one process here; exact or compressed data
parallelism over its devices inside, as any jaxcomp step). Islands train on
their own for ``H`` inner steps; at each outer sync every island present
sends its compressed pseudo-gradient (``anchor - local``, with error
feedback) to the others, decodes and averages them in JAX, and takes the
outer step in JAX. Membership is torchft's (Lighthouse quorum, one
``Manager`` per island, a gloo process group re-created per quorum):

* a sync that fails (a peer died mid-interval, a timeout) is reported to
  the manager, ``should_commit`` is false on that island and the interval
  is discarded: no partial average is applied, the anchor, outer state,
  error-feedback residual and step are left as they were, and nothing is
  checkpointed;
* a lost island is dropped at the next quorum (torchft's Lighthouse: no
  heartbeat for ``heartbeat_timeout_ms``), and the survivors average over
  the islands present, each with weight ``1 / islands`` (DiLoCo's mean);
* an island that comes back, or a replacement, heals at the quorum: it
  receives the *anchor* (outer parameters, outer-optimizer state, the step,
  the configuration's fingerprint) from a peer through torchft's
  ``state_dict`` hooks (its process-group checkpoint transport, over the
  same gloo group); its own
  error-feedback residual starts at zero (a residual is what *that*
  island has not sent yet: a donor's belongs to the donor);
* the anchor is saved with Orbax at every commit (``checkpoint_dir/<island>``),
  so a replacement started after every peer has gone restores the newest
  anchor of any island instead of starting from step 0.

Only this module imports torch and torchft (``pip install
"jaxcomp[elastic]"``); nothing else in jaxcomp needs them.

Example (one island; start one per island, and the Lighthouse once, e.g.
``python -m jaxcomp.elastic lighthouse --min-replicas 2``)::

  isl = ElasticDiLoCo(params, island="a", lighthouse="http://host:29510",
                      compressor="int8_block", checkpoint_dir="/ckpt")
  while isl.step < outer_steps:
    params = isl.begin()          # quorum; heals a (re)joining island
    for _ in range(H):
      params, inner_state = train_step(params, inner_state, batch())
    result = isl.sync(params)     # committed or discarded, as a whole

References:
  Douillard et al., DiLoCo: Distributed Low-Communication Training of
  Language Models <https://arxiv.org/abs/2311.08105>, 2023; torchft
  (Manager, Lighthouse, ProcessGroupGloo, PGTransport),
  <https://github.com/pytorch/torchft>, version 0.2.0; Jaghouar et al.,
  INTELLECT-1 Technical Report <https://arxiv.org/abs/2412.01152>, 2024
  (islands joining at outer steps).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import optax

from jaxcomp import compressors

try:
  import torch  # pyright: ignore[reportMissingImports]
  import torch.distributed as tdist  # pyright: ignore[reportMissingImports]
  import torchft  # pyright: ignore[reportMissingImports]
  from torchft import coordination  # pyright: ignore[reportMissingImports]
  from torchft.checkpointing.pg_transport import (  # pyright: ignore[reportMissingImports]
      PGTransport)
  from torch.distributed.distributed_c10d import (  # pyright: ignore[reportMissingImports]
      AllgatherOptions)  # pyright: ignore[reportPrivateImportUsage]
except ImportError as e:  # pragma: no cover - exercised without the extra
  raise ImportError(
      "jaxcomp.elastic needs torch and torchft: pip install "
      f"'jaxcomp[elastic]' ({e})") from e

_HEADER_BYTES = 40  # sha256 fingerprint (32) + payload length (int64)


class ElasticConfigError(ValueError):
  """Islands disagree on the model or the configuration (a joiner with
  another model, another compressor, other hyperparameters)."""


class QuorumError(RuntimeError):
  """No commit for longer than ``quorum_timeout``: fewer islands than
  ``min_islands`` (or none reachable). Nothing was lost: the anchor of the
  last commit is in memory and, with ``checkpoint_dir``, on disk."""


class SyncResult(NamedTuple):
  """What one :meth:`ElasticDiLoCo.sync` did.

  Attributes:
    committed: whether the interval was applied (torchft's
      ``should_commit``); False: discarded as a whole.
    islands: islands in this interval's quorum (the exchange's size).
    step: outer steps committed so far (torchft's step), after this sync.
    params: the parameters to continue from: the new anchor when
      committed, the unchanged anchor when not (the interval's inner
      steps are discarded with it).
    seconds: wall time of the exchange, decode and outer step (s).
    bytes_sent: this island's payload, bytes (header not counted).
    error: the exception that made the sync fail, or None.
  """

  committed: bool
  islands: int
  step: int
  params: Any
  seconds: float
  bytes_sent: int
  error: BaseException | None


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each parameter and each payload array sits in the flat buffers."""

  treedef: Any
  shapes: tuple[tuple[int, ...], ...]
  dtypes: tuple[Any, ...]
  n: int  # parameter elements, the pseudo-gradient buffer's length
  payload: tuple[jax.ShapeDtypeStruct, ...]  # the compressor's arrays
  payload_treedef: Any

  @property
  def payload_bytes(self) -> int:
    return sum(int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
               for s in self.payload)


def _describe(params, outer_state, compressor, error_feedback: bool,
              config) -> dict:
  """The configuration every island must share (JSON-able)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  o_leaves, o_treedef = jax.tree.flatten(outer_state)
  return {
      "params": [[jax.tree_util.keystr(p), list(np.shape(x)),
                  str(np.asarray(x).dtype)] for p, x in leaves],
      "params_tree": str(treedef),
      "outer_state": [[list(np.shape(x)), str(np.asarray(x).dtype)]
                      for x in o_leaves],
      "outer_state_tree": str(o_treedef),
      "compressor": repr(compressor),
      "error_feedback": bool(error_feedback),
      "config": json.loads(json.dumps(config or {}, sort_keys=True,
                                      default=str)),
  }


def _fingerprint(description: dict) -> str:
  return hashlib.sha256(json.dumps(description, sort_keys=True)
                        .encode()).hexdigest()


def _differences(mine: dict, theirs: dict) -> str:
  keys = sorted(k for k in set(mine) | set(theirs)
                if mine.get(k) != theirs.get(k))
  return "; ".join(f"{k}: this island {mine.get(k)!r}, peer "
                   f"{theirs.get(k)!r}" for k in keys) or "(same description)"


def _to_bytes(x) -> np.ndarray:
  """A leaf's bytes as a flat uint8 array (any dtype, bfloat16 included)."""
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def _from_bytes(buf: np.ndarray, shape, dtype) -> np.ndarray:
  return np.frombuffer(buf.tobytes(), dtype=np.dtype(dtype)).reshape(shape)


def _own_address() -> str:
  """This machine's hostname resolved to an address (what peers dial): the
  hostname itself would resolve to each peer's own address where every
  network namespace maps it to its veth (``/etc/netns/NAME/hosts``)."""
  name = socket.gethostname()
  try:
    return socket.gethostbyname(name)
  except OSError:
    return name


def _process_copy(x):
  """This process's copy of a leaf replicated over the island's processes
  (a global ``jax.Array`` of a multi-process island); other values as they
  are.

  Raises:
    ValueError: a multi-process leaf that is not replicated (FSDP shards:
      gather them before the sync).
  """
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    if not x.sharding.is_fully_replicated:
      raise ValueError(
          "sync needs the island's parameters replicated over its processes "
          f"(sharding P()), got {x.sharding}: gather the shards first")
    return x.addressable_data(0)
  return x


def digest(tree) -> str:
  """sha256 of a pytree's leaves' bytes (in ``jax.tree.leaves`` order):
  equal digests mean bitwise equal leaves."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(_to_bytes(x).tobytes())
  return h.hexdigest()


class ElasticDiLoCo:
  """One island's side of elastic DiLoCo (see the module docstring).

  Args:
    params: the initial parameters (a pytree of arrays, identical on every
      island: the same seed). Their structure, shapes and dtypes are part
      of the configuration every island must share.
    island: this island's name (torchft's ``replica_id``; also its
      checkpoint folder). A restarted island keeps its name. Default:
      ``JAXCOMP_ISLAND`` (set by ``python -m jaxcomp.elastic islands``).
    lighthouse: the Lighthouse's address, e.g. ``"http://host:29510"``.
      Default: ``JAXCOMP_LIGHTHOUSE``.
    outer: the outer optimizer; default ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)`` (DiLoCo's).
    compressor: the pseudo-gradient's compressor, a name or instance as
      :func:`jaxcomp.compressors.get` takes (``"int8_block"``,
      ``"topk"``, ``"chunked_topk"``, ...); ``compressor_kwargs`` its
      hyperparameters. Encoded on the flat float32 buffer of all
      parameters (``n`` elements).
    error_feedback: keep the residual ``v - decode(encode(v))`` with ``v =
      pseudo + residual`` (EF-SGD; SparseLoCo keeps one), default True.
    min_islands: torchft's ``min_replica_size``: a sync with fewer
      islands does not commit.
    checkpoint_dir: Orbax checkpoints of the anchor at each commit, in
      ``checkpoint_dir/<island>``; at start the newest step of any island
      there is restored. None: no checkpoints.
    config: more settings every island must share (``sync_every``, learning
      rates, ...), JSON-able; compared with the peers' like the model.
    timeout: seconds for the exchange and the heal (torchft's
      ``timeout``, the gloo group's timeout).
    quorum_timeout: seconds to wait for a quorum (torchft's), and the
      longest time without a commit before :class:`QuorumError`. Must
      exceed ``H`` x the step time + an island's restart time.
    connect_timeout: seconds to reach the Lighthouse and the managers.
    hostname: the address peers reach this island at (torchft's
      ``hostname``; in a network namespace, its veth address). Default:
      this machine's hostname resolved to an address.
    store_host: the address of the island's process 0 for its TCP store,
      where the island's torchft managers meet and where the other islands
      rendezvous for the process group when this island leads a quorum
      (torchft passes the store's address in the quorum): it must be
      reachable from every island. Default: this machine's hostname
      resolved to an address (in a network namespace, map the hostname to
      the veth address in ``/etc/netns/NAME/hosts``); ``"localhost"`` only
      when every island runs on one machine. An island of several JAX processes
      (``jax.distributed``) runs one torchft manager per process (torchft's
      group ranks); each exchanges the whole payload with the same rank of
      the other islands, and the island commits only when all of its
      processes do.
    seed: the compressor's shared randomness, ``fold_in(key(seed), step)``.

  Raises:
    ImportError: at import, without torch and torchft.
    ElasticConfigError: the checkpoint restored at start, or the anchor a
      peer sends at a heal, comes from another configuration; or a peer in
      the exchange has another configuration.
    QuorumError: (from :meth:`begin` and :meth:`sync`) no commit for
      ``quorum_timeout`` seconds.
  """

  def __init__(self, params, *, island: str | None = None,
               lighthouse: str | None = None,
               outer: optax.GradientTransformation | None = None,
               compressor: str | compressors.Compressor = "int8_block",
               compressor_kwargs: dict | None = None,
               error_feedback: bool = True, min_islands: int = 1,
               checkpoint_dir: str | None = None, config: dict | None = None,
               timeout: float = 30.0, quorum_timeout: float = 300.0,
               connect_timeout: float = 30.0, hostname: str | None = None,
               store_host: str | None = None, seed: int = 0):
    island = island or os.environ.get("JAXCOMP_ISLAND", "")
    lighthouse = lighthouse or os.environ.get("JAXCOMP_LIGHTHOUSE")
    if not lighthouse:
      raise ValueError("lighthouse not given and JAXCOMP_LIGHTHOUSE not set: "
                       "pass the Lighthouse's address, e.g. "
                       "'http://host:29510'")
    if not island or "/" in island or ":" in island:
      raise ValueError(f"island must be a non-empty name without '/' or "
                       f"':', got {island=!r}")
    if min_islands < 1:
      raise ValueError(f"min_islands must be >= 1, got {min_islands=}")
    self.island = island
    self._outer = (optax.sgd(0.7, momentum=0.9, nesterov=True)
                   if outer is None else outer)
    self._comp = compressors.get(compressor, **(compressor_kwargs or {}))
    if self._comp.own_exchange:
      raise ValueError(f"compressor {self._comp.name!r} runs its own "
                       "collective exchange; elastic islands need an "
                       "encode/decode compressor (int8_block, topk, ...)")
    self._ef = bool(error_feedback)
    self._key = jax.random.key(seed)
    self._quorum_timeout = float(quorum_timeout)

    anchor = jax.tree.map(lambda x: jnp.asarray(x), params)
    outer_state = self._outer.init(anchor)
    self._description = _describe(anchor, outer_state, self._comp, self._ef,
                                  config)
    self.fingerprint = _fingerprint(self._description)
    self._layout = self._plan(anchor)
    self._anchor, self._outer_state = anchor, outer_state
    self._residual = jnp.zeros((self._layout.n,), jnp.float32)
    self._jit()
    self.healed = False  # whether the last begin() healed from a peer
    self.heal_seconds = 0.0  # the last heal's wall time, s
    self.heal_bytes = 0  # the last heal's anchor and outer state, bytes
    self.restored_step: int | None = None  # step restored from Orbax at start

    self._ckpt_root = checkpoint_dir
    self._ckpt = None
    restored = self._restore() if checkpoint_dir else None

    timeout_td = timedelta(seconds=timeout)
    rank, size = jax.process_index(), jax.process_count()
    # This island's own store, on its process 0 (its managers meet in it);
    # its host and port go to the island's other processes.
    self._store = None
    host = (store_host or _own_address()).encode()
    port = 0
    if rank == 0:
      self._store = tdist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
          host.decode(), 0, is_master=True, wait_for_workers=False)
      port = self._store.port
    if size > 1:
      if len(host) > 255:
        raise ValueError(f"store_host longer than 255 bytes: {host!r}")
      sent = np.zeros((257,), np.int32)  # port, length, bytes of the host
      sent[0], sent[1] = port, len(host)
      sent[2:2 + len(host)] = np.frombuffer(host, np.uint8)
      got = np.asarray(multihost_utils.broadcast_one_to_all(sent))
      port = int(got[0])
      host = bytes(got[2:2 + int(got[1])].astype(np.uint8))
    self._pg = torchft.ProcessGroupGloo(timeout=timeout_td)
    self._manager = torchft.Manager(
        pg=self._pg, load_state_dict=self._load_state_dict,
        state_dict=self._state_dict, min_replica_size=min_islands,
        use_async_quorum=False, timeout=timeout_td,
        quorum_timeout=timedelta(seconds=quorum_timeout),
        connect_timeout=timedelta(seconds=connect_timeout), rank=rank,
        world_size=size, store_addr=host.decode(), store_port=port,
        lighthouse_addr=lighthouse, replica_id=island,
        hostname=hostname or _own_address(), init_sync=True,
        # The heal travels through the gloo group itself: no second
        # address to advertise (torchft's HTTP transport advertises the
        # hostname, which another network namespace resolves to itself).
        checkpoint_transport=PGTransport(self._pg, timeout=timeout_td,
                                         device=torch.device("cpu")))
    if restored is not None:
      self._manager.load_state_dict({"step": restored,
                                     "batches_committed": 0})
    self._last_commit = time.monotonic()

  # -- construction -----------------------------------------------------

  def _plan(self, anchor) -> _Layout:
    leaves, treedef = jax.tree.flatten(anchor)
    n = sum(int(np.prod(np.shape(x))) for x in leaves)
    self._comp.check_size(n)
    out = jax.eval_shape(lambda v, k: self._comp.encode(v, k),
                         jax.ShapeDtypeStruct((n,), jnp.float32), self._key)
    p_leaves, p_treedef = jax.tree.flatten(out)
    return _Layout(treedef=treedef,
                   shapes=tuple(tuple(np.shape(x)) for x in leaves),
                   dtypes=tuple(np.asarray(x).dtype for x in leaves), n=n,
                   payload=tuple(jax.ShapeDtypeStruct(s.shape, s.dtype)
                                 for s in p_leaves),
                   payload_treedef=p_treedef)

  def _jit(self) -> None:
    comp, lay, ef = self._comp, self._layout, self._ef

    def encode(anchor, local, residual, key):
      pseudo = jnp.concatenate([
          (a.astype(jnp.float32) - x.astype(jnp.float32)).reshape(-1)
          for a, x in zip(jax.tree.leaves(anchor), jax.tree.leaves(local))])
      v = pseudo + residual if ef else pseudo
      payload = comp.encode(v, key)
      sent = comp.decode(payload, lay.n, key)
      new_residual = v - sent if ef else residual
      return jax.tree.leaves(payload), new_residual

    def decode_mean(payloads, key):
      # payloads: per payload array, the islands' stacked (islands, ...).
      islands = payloads[0].shape[0]
      total = jnp.zeros((lay.n,), jnp.float32)
      for i in range(islands):  # rank order: the same sum on every island
        tree = jax.tree.unflatten(lay.payload_treedef,
                                  [p[i] for p in payloads])
        total = total + comp.decode(tree, lay.n, key)
      return total / jnp.float32(islands)

    def outer_step(anchor, outer_state, mean):
      parts, off = [], 0
      for shape, dtype in zip(lay.shapes, lay.dtypes):
        size = int(np.prod(shape))
        parts.append(mean[off:off + size].reshape(shape).astype(dtype))
        off += size
      avg = jax.tree.unflatten(lay.treedef, parts)
      updates, outer_state = self._outer.update(avg, outer_state, anchor)
      return optax.apply_updates(anchor, updates), outer_state

    self._encode = jax.jit(encode)
    self._decode_mean = jax.jit(decode_mean)
    self._outer_step = jax.jit(outer_step)

  # -- the anchor, as torchft's state_dict hooks carry it ----------------

  @property
  def step(self) -> int:
    """Outer steps committed (torchft's step)."""
    return int(self._manager.current_step())

  @property
  def anchor(self):
    """The synchronized parameters (identical on every island at a
    step)."""
    return self._anchor

  @property
  def outer_state(self):
    return self._outer_state

  @property
  def residual(self) -> jax.Array:
    """This island's error-feedback residual, float32 ``(n,)``."""
    return self._residual

  def _state_dict(self) -> dict:
    leaves = jax.tree.leaves((self._anchor, self._outer_state))
    return {"fingerprint": self.fingerprint,
            "description": json.dumps(self._description),
            "leaves": [torch.from_numpy(_to_bytes(x).copy()) for x in leaves]}

  def _load_state_dict(self, sd: dict) -> None:
    """A heal: the anchor from a peer. Raises ElasticConfigError when the
    peer's configuration is not this island's."""
    if sd.get("fingerprint") != self.fingerprint:
      theirs = json.loads(sd.get("description", "{}"))
      raise ElasticConfigError(
          f"island {self.island!r} cannot join: the quorum trains another "
          f"model or configuration ({_differences(self._description, theirs)})."
          " Start it with the same parameters, compressor and config.")
    like = jax.tree.leaves((self._anchor, self._outer_state))
    leaves = [jnp.asarray(_from_bytes(t.numpy(), np.shape(x),
                                      np.asarray(x).dtype))
              for t, x in zip(sd["leaves"], like)]
    treedef = jax.tree.structure((self._anchor, self._outer_state))
    self._anchor, self._outer_state = jax.tree.unflatten(treedef, leaves)
    # A residual is what this island has not sent: a joiner has none.
    self._residual = jnp.zeros((self._layout.n,), jnp.float32)
    self.healed = True

  # -- Orbax ---------------------------------------------------------------

  def _manager_for(self, path: str):
    import orbax.checkpoint as ocp  # optional: only with checkpoint_dir
    return ocp, ocp.CheckpointManager(
        path, options=ocp.CheckpointManagerOptions(
            max_to_keep=2, enable_async_checkpointing=False, create=True))

  def _save(self, step: int) -> None:
    if not self._ckpt_root:
      return
    if self._ckpt is None:
      self._ckpt = self._manager_for(os.path.join(self._ckpt_root,
                                                  self.island))
    ocp, mgr = self._ckpt
    # Host values: the same on every process of the island (Orbax writes
    # them once).
    state = jax.tree.map(np.asarray, {
        "anchor": self._anchor, "outer_state": self._outer_state,
        "residual": self._residual})
    mgr.save(step, args=ocp.args.Composite(
        state=ocp.args.StandardSave(state),
        meta=ocp.args.JsonSave({"fingerprint": self.fingerprint,
                                "description": self._description,
                                "step": step, "island": self.island,
                                "digest": digest(self._anchor)})))
    mgr.wait_until_finished()

  def _restore(self) -> int | None:
    """Restores the newest anchor of any island under ``checkpoint_dir``;
    returns its step, or None when there is none."""
    root = self._ckpt_root
    assert root is not None
    best = None
    for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
      path = os.path.join(root, name)
      if not os.path.isdir(path):
        continue
      ocp, mgr = self._manager_for(path)
      step = mgr.latest_step()
      if step is not None and (best is None or step > best[0]):
        best = (step, name, ocp, mgr)
    if best is None:
      return None
    step, name, ocp, mgr = best
    meta = mgr.restore(step, args=ocp.args.Composite(
        meta=ocp.args.JsonRestore()))["meta"]
    if meta["fingerprint"] != self.fingerprint:
      raise ElasticConfigError(
          f"the checkpoint {os.path.join(root, name)} (step {step}) holds "
          f"another model or configuration ("
          f"{_differences(self._description, meta['description'])}); use "
          "another checkpoint_dir or the same configuration")
    template = jax.tree.map(np.asarray, {
        "anchor": self._anchor, "outer_state": self._outer_state,
        "residual": self._residual})
    state = mgr.restore(step, args=ocp.args.Composite(
        state=ocp.args.StandardRestore(template)))["state"]
    self._anchor = jax.tree.map(jnp.asarray, state["anchor"])
    self._outer_state = jax.tree.map(jnp.asarray, state["outer_state"])
    # Another island's residual is not ours (see _load_state_dict).
    self._residual = (jnp.asarray(state["residual"]) if name == self.island
                      else jnp.zeros((self._layout.n,), jnp.float32))
    self.restored_step = int(step)
    return int(step)

  # -- the loop --------------------------------------------------------------

  def _check_deadline(self) -> None:
    idle = time.monotonic() - self._last_commit
    if idle > self._quorum_timeout:
      raise QuorumError(
          f"island {self.island!r}: no commit for {idle:.0f} s (> "
          f"quorum_timeout={self._quorum_timeout:.0f} s): fewer islands "
          "than min_islands, or none reachable; the last anchor (step "
          f"{self.step}) is kept" + (" and checkpointed" if self._ckpt_root
                                     else ""))

  def begin(self):
    """Starts an interval: torchft's quorum (blocking), which heals this
    island from a peer if it is behind (:attr:`healed`; then
    :attr:`heal_seconds`, the quorum and transfer's wall time in seconds,
    and :attr:`heal_bytes`, the anchor's and outer state's bytes
    received). Returns the anchor to start the interval's inner steps
    from.

    Raises:
      ElasticConfigError: the peer's anchor has another configuration.
      QuorumError: no quorum for ``quorum_timeout`` seconds.
    """
    self.healed = False
    t0 = time.monotonic()
    try:
      self._manager.start_quorum()
    except ElasticConfigError:
      raise
    except Exception as e:  # torchft raises the RPC's error on a timeout
      self._check_deadline()
      raise QuorumError(f"island {self.island!r}: no quorum: {e}") from e
    if self.healed:
      self.heal_seconds = time.monotonic() - t0
      self.heal_bytes = sum(_to_bytes(x).size for x in jax.tree.leaves(
          (self._anchor, self._outer_state)))
    return self._anchor

  @property
  def islands(self) -> int:
    """Islands in the current quorum."""
    return int(self._manager.num_participants())

  def _allgather(self, buf: np.ndarray, islands: int) -> list[np.ndarray]:
    t = torch.from_numpy(buf)
    out = [torch.empty_like(t) for _ in range(islands)]
    self._pg.allgather([out], [t], AllgatherOptions()).wait()
    return [o.numpy() for o in out]

  def _exchange(self, local) -> tuple[Any, Any, jax.Array, int]:
    """Encodes, all-gathers and averages. Returns the new anchor, outer
    state and residual (not yet applied), and the payload's bytes."""
    islands = self.islands
    key = jax.random.fold_in(self._key, self.step)
    payload, residual = self._encode(self._anchor, local, self._residual,
                                     key)
    buf = np.concatenate([_to_bytes(p) for p in payload])
    header = np.concatenate([
        np.frombuffer(bytes.fromhex(self.fingerprint), np.uint8),
        np.array([buf.size], np.int64).view(np.uint8)])
    assert header.size == _HEADER_BYTES, header.size
    headers = self._allgather(header, islands)
    bad = [i for i, h in enumerate(headers)
           if h[:32].tobytes().hex() != self.fingerprint]
    if bad:
      raise ElasticConfigError(
          f"island {self.island!r}: the peers of rank(s) {bad} in this "
          "exchange have another model or configuration (their fingerprint "
          "differs); every island must start with the same parameters, "
          "compressor and config")
    bufs = self._allgather(buf, islands)
    stacked, off = [], 0
    for s in self._layout.payload:
      nb = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
      stacked.append(jnp.asarray(np.stack(
          [_from_bytes(b[off:off + nb], s.shape, s.dtype) for b in bufs])))
      off += nb
    mean = self._decode_mean(stacked, key)
    anchor, outer_state = self._outer_step(self._anchor, self._outer_state,
                                           mean)
    jax.block_until_ready((anchor, outer_state, residual))
    return anchor, outer_state, residual, int(buf.size)

  def sync(self, local) -> SyncResult:
    """Ends an interval: exchanges ``anchor - local`` (compressed, with
    error feedback), averages it over the islands present and takes the
    outer step, then asks torchft whether to commit. Only on commit are
    the anchor, outer state, residual and step replaced (and the anchor
    checkpointed); otherwise all stay as they were.

    Args:
      local: this island's parameters after the interval's inner steps,
        the anchor's structure, shapes and dtypes (in a multi-process
        island, global arrays replicated over its processes).

    Returns:
      A :class:`SyncResult`; continue from its ``params``.

    Raises:
      ElasticConfigError: a peer in the exchange has another configuration
        (raised on every island of the exchange; nothing is committed).
      QuorumError: no commit for ``quorum_timeout`` seconds.
    """
    t0 = time.monotonic()
    local = jax.tree.map(_process_copy, local)
    islands = self.islands
    new, error, nbytes = None, None, 0
    if self._manager.errored() is None:
      try:
        *new, nbytes = self._exchange(local)
      except ElasticConfigError as e:
        self._manager.report_error(e)
        self._manager.should_commit()
        raise
      except Exception as e:  # a lost peer, a timeout: discard the interval
        error = e
        self._manager.report_error(e)
    else:
      error = self._manager.errored()
    committed = bool(self._manager.should_commit())
    if committed and new is not None:
      self._anchor, self._outer_state, self._residual = new
      self._save(self.step)
      self._last_commit = time.monotonic()
    else:
      committed = False
      self._check_deadline()
    return SyncResult(committed=committed, islands=islands, step=self.step,
                      params=self._anchor, seconds=time.monotonic() - t0,
                      bytes_sent=nbytes, error=error)

  def close(self) -> None:
    """Shuts down this island's torchft manager (and its servers)."""
    self._manager.shutdown(wait=False)


def lighthouse(bind: str = "[::]:0", *, min_replicas: int = 1,
               join_timeout_ms: int = 5000, heartbeat_timeout_ms: int = 2000,
               quorum_tick_ms: int = 100):
  """Starts torchft's Lighthouse (the quorum service) in this process.

  Args:
    bind: ``host:port`` to listen on; port 0 picks a free one.
    min_replicas: islands needed for any quorum.
    join_timeout_ms: how long a quorum waits for heartbeating islands that
      have not asked to join yet (ms).
    heartbeat_timeout_ms: an island silent this long is dropped (ms); the
      survivors' next quorum forms about this long after a loss.
    quorum_tick_ms: how often the quorum is re-evaluated (ms).

  Returns:
    torchft's ``LighthouseServer``; ``.address()`` is what islands pass as
    ``lighthouse``; ``.shutdown()`` stops it.
  """
  return coordination.LighthouseServer(
      bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
      quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)


def _island_env(name: str, address: str) -> dict[str, str]:
  return {**os.environ, "JAXCOMP_ISLAND": name,
          "JAXCOMP_LIGHTHOUSE": address}


def _pump(stream, prefix: str) -> None:
  for line in iter(stream.readline, b""):
    sys.stdout.write(f"{prefix} {line.decode(errors='replace')}")
    sys.stdout.flush()


def _start_island(name: str, command: Sequence[str], processes: int,
                  address: str) -> subprocess.Popen:
  argv = list(command)
  if processes > 1:  # jaxcomp.launch: one JAX job of `processes` processes
    argv = [sys.executable, "-m", "jaxcomp.launch", "-n", str(processes),
            "--", *argv]
  proc = subprocess.Popen(argv, env=_island_env(name, address),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
  threading.Thread(target=_pump, args=(proc.stdout, f"[{name}]"),
                   daemon=True).start()
  return proc


def run_islands(command: Sequence[str], islands: int, *, processes: int = 1,
                min_replicas: int | None = None,
                heartbeat_timeout_ms: int = 2000,
                join_timeout_ms: int = 5000,
                restart_delay: float | None = None,
                max_restarts: int = 3) -> int:
  """Starts the Lighthouse and ``islands`` islands of ``processes`` JAX
  processes each on this machine, and waits for them.

  Each island runs ``command`` with ``JAXCOMP_ISLAND`` (its name, ``i0``,
  ``i1``, ...) and ``JAXCOMP_LIGHTHOUSE`` (the Lighthouse's address) in its
  environment, which :class:`ElasticDiLoCo` reads when ``island`` and
  ``lighthouse`` are not given; several processes per island go through
  ``python -m jaxcomp.launch -n processes``. Output lines are prefixed
  with ``[<island>]``.

  Args:
    command: the island program and its arguments.
    islands: how many islands, >= 1.
    processes: JAX processes per island, >= 1.
    min_replicas: the Lighthouse's minimum quorum; default 2 when there are
      several islands (a restarted island never forms a quorum alone), else 1.
    heartbeat_timeout_ms, join_timeout_ms: the Lighthouse's (see
      :func:`lighthouse`).
    restart_delay: restart an island that exits non-zero (a SIGKILL
      included) after this many seconds, at most ``max_restarts`` times per
      island; None: do not restart.
    max_restarts: restarts allowed per island.

  Returns:
    0 when every island exited 0, else the last failing island's exit
    status (128 + signal number for a signal).

  Raises:
    ValueError: ``islands`` or ``processes`` below 1, an empty command.
  """
  if islands < 1 or processes < 1 or not command:
    raise ValueError(f"need islands >= 1, processes >= 1 and a command, got "
                     f"{islands=}, {processes=}, {command=}")
  server = lighthouse("[::]:0", min_replicas=min_replicas or min(2, islands),
                      join_timeout_ms=join_timeout_ms,
                      heartbeat_timeout_ms=heartbeat_timeout_ms)
  address = server.address()
  print(f"[lighthouse] {address}", flush=True)
  names = [f"i{k}" for k in range(islands)]
  procs = {n: _start_island(n, command, processes, address) for n in names}
  restarts = dict.fromkeys(names, 0)
  due: dict[str, float] = {}
  status = 0
  try:
    while procs or due:
      for name, proc in list(procs.items()):
        code = proc.poll()
        if code is None:
          continue
        del procs[name]
        code = 128 - code if code < 0 else code
        print(f"[{name}] exited with status {code}", flush=True)
        if code and restart_delay is not None and (
            restarts[name] < max_restarts):
          restarts[name] += 1
          due[name] = time.monotonic() + restart_delay
        elif code:
          status = code
      for name, at in list(due.items()):
        if time.monotonic() >= at:
          del due[name]
          print(f"[{name}] restarting ({restarts[name]} of {max_restarts})",
                flush=True)
          procs[name] = _start_island(name, command, processes, address)
      time.sleep(0.1)
  finally:
    for proc in procs.values():
      proc.kill()
    server.shutdown()
  return status


def main(argv: Sequence[str] | None = None) -> int:
  """The command line: ``python -m jaxcomp.elastic lighthouse`` runs the
  Lighthouse until interrupted, printing its address; ``python -m
  jaxcomp.elastic islands -n 3 -m 2 -- python island.py ...`` runs
  :func:`run_islands`."""
  p = argparse.ArgumentParser(prog="python -m jaxcomp.elastic")
  sub = p.add_subparsers(dest="command", required=True)
  lh = sub.add_parser("lighthouse", help="run torchft's quorum service")
  lh.add_argument("--bind", default="[::]:29510")
  lh.add_argument("--min-replicas", type=int, default=1)
  lh.add_argument("--join-timeout-ms", type=int, default=5000)
  lh.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
  isl = sub.add_parser("islands", help="run the Lighthouse and N islands of "
                       "M JAX processes each on this machine")
  isl.add_argument("-n", "--islands", type=int, default=2)
  isl.add_argument("-m", "--processes", type=int, default=1,
                   help="JAX processes per island (jaxcomp.launch)")
  isl.add_argument("--min-replicas", type=int, default=None)
  isl.add_argument("--join-timeout-ms", type=int, default=5000)
  isl.add_argument("--heartbeat-timeout-ms", type=int, default=2000)
  isl.add_argument("--restart-delay", type=float, default=None,
                   help="restart a failed island after this many seconds")
  isl.add_argument("--max-restarts", type=int, default=3)
  isl.add_argument("cmd", nargs=argparse.REMAINDER,
                   help="-- then the island's command")
  args = p.parse_args(argv)
  if args.command == "islands":
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    return run_islands(cmd, args.islands, processes=args.processes,
                       min_replicas=args.min_replicas,
                       heartbeat_timeout_ms=args.heartbeat_timeout_ms,
                       join_timeout_ms=args.join_timeout_ms,
                       restart_delay=args.restart_delay,
                       max_restarts=args.max_restarts)
  server = lighthouse(args.bind, min_replicas=args.min_replicas,
                      join_timeout_ms=args.join_timeout_ms,
                      heartbeat_timeout_ms=args.heartbeat_timeout_ms)
  print(server.address(), flush=True)
  try:
    while True:
      time.sleep(3600)
  except KeyboardInterrupt:
    server.shutdown()
  return 0


if __name__ == "__main__":
  raise SystemExit(main())
