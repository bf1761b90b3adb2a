"""One island's side of elastic DiLoCo on torchft: the manager, the quorum
(:meth:`ElasticDiLoCo.begin`, which heals a joiner), the exchange and
commit (:meth:`ElasticDiLoCo.sync`), and torchft's Lighthouse.

The one module of jaxcomp that imports torch and torchft (``pip install
"jaxcomp[elastic]"``), and only when an island or a Lighthouse is made:
``import jaxcomp.elastic`` works without them.
"""

from __future__ import annotations

import gc
import json
import math
import time
import types
from datetime import timedelta
from typing import Any

import jax
import jax.numpy as jnp
from jax.experimental import multihost_utils
import numpy as np
import optax

from jaxcomp import compressors
from jaxcomp.elastic import _exchange
from jaxcomp.elastic import _outer
from jaxcomp.elastic import _shares
from jaxcomp.elastic._anchor import AnchorCheckpoints
from jaxcomp.elastic._common import ElasticConfigError
from jaxcomp.elastic._common import QuorumError
from jaxcomp.elastic._common import SyncResult
from jaxcomp.elastic._common import describe
from jaxcomp.elastic._common import differences
from jaxcomp.elastic._common import fingerprint
from jaxcomp.elastic._common import from_bytes
from jaxcomp.elastic._common import check_names
from jaxcomp.elastic._common import own_address
from jaxcomp.elastic._common import to_bytes

_WAIT_POLL_S = 0.5  # pause between start quorums below ``wait_for``


def _torch() -> types.SimpleNamespace:
  """torch and torchft, imported on first use (an island's or a
  Lighthouse's), with Python's cyclic garbage collector paused.

  The import runs after the island's JAX work (its model, its step), when
  the heap holds hundreds of thousands of objects that every collection
  during torch's thousands of module imports scans again: 5.0 s against
  3.3 s paused in one process on a 2-core machine, where the 6 island
  processes of ``tests/test_elastic.py`` had not made their islands in
  90 s with the collector running.

  Raises:
    ImportError: without them, naming the extra to install.
  """
  gc_was_on = gc.isenabled()
  gc.disable()
  try:
    import torch  # pyright: ignore[reportMissingImports]
    import torch.distributed as tdist  # pyright: ignore[reportMissingImports]
    import torchft  # pyright: ignore[reportMissingImports]
    from torchft import coordination  # pyright: ignore[reportMissingImports]
    from torchft.checkpointing.pg_transport import (  # pyright: ignore[reportMissingImports]
        PGTransport)
  except ImportError as e:
    raise ImportError(
        "jaxcomp.elastic's islands and Lighthouse need torch and torchft: "
        f"pip install 'jaxcomp[elastic]' ({e})") from e
  finally:
    if gc_was_on:
      gc.enable()
  return types.SimpleNamespace(
      torch=torch, tdist=tdist, torchft=torchft, coordination=coordination,
      PGTransport=PGTransport)


def _island_store(store_host: str | None):
  """The island's own TCP store, on its process 0 (its managers meet in
  it), and its host and port, sent to the island's other processes.
  Returns ``(store or None, host, port)``."""
  tt = _torch()
  rank, size = jax.process_index(), jax.process_count()
  store = None
  host = (store_host or own_address()).encode()
  port = 0
  if rank == 0:
    store = tt.tdist.TCPStore(  # pyright: ignore[reportPrivateImportUsage]
        host.decode(), 0, is_master=True, wait_for_workers=False)
    port = store.port
  if size > 1:
    if len(host) > 255:
      raise ValueError(f"store_host longer than 255 bytes: {host!r}")
    sent = np.zeros((257,), np.int32)  # port, length, bytes of the host
    sent[0], sent[1] = port, len(host)
    sent[2:2 + len(host)] = np.frombuffer(host, np.uint8)
    got = np.asarray(multihost_utils.broadcast_one_to_all(sent))
    port = int(got[0])
    host = bytes(got[2:2 + int(got[1])].astype(np.uint8))
  return store, host.decode(), port


def _manager(island: str, lighthouse: str, *, state_dict, load_state_dict,
             min_islands: int, timeout: float, quorum_timeout: float,
             connect_timeout: float, hostname: str | None,
             store_host: str | None):
  """torchft's gloo process group and Manager for this process of the
  island. Returns ``(store, process group, manager)``."""
  tt = _torch()
  timeout_td = timedelta(seconds=timeout)
  store, host, port = _island_store(store_host)
  pg = tt.torchft.ProcessGroupGloo(timeout=timeout_td)
  manager = tt.torchft.Manager(
      pg=pg, load_state_dict=load_state_dict, state_dict=state_dict,
      min_replica_size=min_islands, use_async_quorum=False,
      timeout=timeout_td, quorum_timeout=timedelta(seconds=quorum_timeout),
      connect_timeout=timedelta(seconds=connect_timeout),
      rank=jax.process_index(), world_size=jax.process_count(),
      store_addr=host, store_port=port, lighthouse_addr=lighthouse,
      replica_id=island, hostname=hostname or own_address(), init_sync=True,
      # The heal travels through the gloo group itself: no second
      # address to advertise (torchft's HTTP transport advertises the
      # hostname, which another network namespace resolves to itself).
      checkpoint_transport=tt.PGTransport(pg, timeout=timeout_td,
                                          device=tt.torch.device("cpu")))
  return store, pg, manager


class ElasticDiLoCo:
  """One island's side of elastic DiLoCo (see :mod:`jaxcomp.elastic`).

  Args:
    params: the initial parameters (a pytree of arrays, identical on every
      island: the same seed). Their structure, shapes and dtypes are part
      of the configuration every island must share. In an island of
      several processes, host values or replicated global arrays are held
      whole by every process; a leaf given as a global array sharded over
      the processes (FSDP: each process's devices holding one rectangular
      block) stays sharded: each process sends its own block's share and
      steps it, with no gather, and :attr:`anchor`, :meth:`begin` and the
      sync's ``params`` return it as a global array of that sharding.
    island: this island's name (torchft's ``replica_id``; also its
      checkpoint folder). A restarted island keeps its name. Default:
      ``JAXCOMP_ISLAND`` (set by ``jaxcomp islands``).
    lighthouse: the Lighthouse's address, e.g. ``"http://host:29510"``.
      Default: ``JAXCOMP_LIGHTHOUSE``.
    outer: the outer optimizer; default ``optax.sgd(0.7, momentum=0.9,
      nesterov=True)`` (DiLoCo's).
    compressor: the pseudo-gradient's compressor, a name or instance as
      :func:`jaxcomp.compressors.get` takes (``"int8_block"``,
      ``"topk"``, ``"chunked_topk"``, ...); ``compressor_kwargs`` its
      hyperparameters. Encoded on the flat buffer of all parameters
      (``n`` elements, in their common dtype, float32 where they differ;
      :mod:`jaxcomp.elastic._outer`).
    error_feedback: keep the residual ``v - decode(encode(v))`` with ``v =
      pseudo + residual`` (EF-SGD; SparseLoCo keeps one), default True.
    min_islands: torchft's ``min_replica_size``: a sync with fewer
      islands does not commit.
    wait_for: a clean start: before the run's first commit, a quorum of
      fewer islands is asked again every 0.5 s, so islands still starting
      are waited for (the same on every island). Default:
      ``JAXCOMP_WAIT_FOR`` (``jaxcomp islands --wait-for``), else 1.
    checkpoint_dir: Orbax checkpoints of the anchor at each commit, in
      ``checkpoint_dir/<island>``; at start the newest step of any island
      there is restored. None: no checkpoints. Not with sharded leaves
      (ValueError).
    config: more settings every island must share (``sync_every``, learning
      rates, ...), JSON-able; compared with the peers' like the model.
    timeout: seconds for the exchange and the heal (torchft's
      ``timeout``, the gloo group's timeout): an exchange with a peer that
      is alive but silent fails after it.
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
      group ranks); each sends only its share of the payload (``1/M`` of
      it in an island of ``M`` processes) to the same rank of the other
      islands, the island gathers the averaged shares over its own links
      (a JAX all-gather), and it commits only when all of its processes
      do (:mod:`jaxcomp.elastic._shares`).
    seed: the compressor's shared randomness, ``fold_in(key(seed), step)``
      (folded with the island's rank in the quorum for a compressor with
      independent randomness, as :func:`jaxcomp.compressed_mean` folds the
      device's).

  Raises:
    ImportError: without torch and torchft (``pip install
      "jaxcomp[elastic]"``).
    ValueError: ``checkpoint_dir`` with sharded leaves; a process holding
      more than one rectangle of a leaf.
    ElasticConfigError: the checkpoint restored at start, or the anchor a
      peer sends at a heal, comes from another configuration; or a peer in
      the exchange has another configuration.
    QuorumError: (from :meth:`begin` and :meth:`sync`) no commit for
      ``quorum_timeout`` seconds.

  After each quorum the islands swap a handshake, and at the sync their
  payloads, each island with every other directly
  (:mod:`jaxcomp.elastic._exchange`): a dead island fails every survivor's
  exchange at once. A joiner whose heal is refused flags its handshake and
  leaves; the others exchange without it and commit.
  """

  def __init__(self, params, *, island: str | None = None,
               lighthouse: str | None = None,
               outer: optax.GradientTransformation | None = None,
               compressor: str | compressors.Compressor = "int8_block",
               compressor_kwargs: dict | None = None,
               error_feedback: bool = True, min_islands: int = 1,
               wait_for: int | None = None, checkpoint_dir: str | None = None,
               config: dict | None = None,
               timeout: float = 30.0, quorum_timeout: float = 300.0,
               connect_timeout: float = 30.0, hostname: str | None = None,
               store_host: str | None = None, seed: int = 0):
    island, lighthouse, self._wait_for = check_names(
        island, lighthouse, min_islands, wait_for)
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
    self._timeout = timedelta(seconds=timeout)
    self._ranks: list[int] = []  # the exchange's ranks (handshake's)

    # This process's share of the sync (jaxcomp.elastic._shares): the
    # anchor and outer state are its held blocks, the residual its share.
    self._layout = _shares.layout(params)
    if self._layout.sharded and checkpoint_dir:
      raise ValueError("checkpoint_dir needs the island's parameters "
                       "replicated over its processes (sharded leaves are "
                       "not checkpointed yet)")
    anchor = _shares.held(self._layout, params)
    outer_state = self._outer.init(anchor)
    self._description = describe(params, outer_state, self._comp, self._ef,
                                 config)
    self.fingerprint = fingerprint(self._description)
    self._plan, held_plan = _shares.plans(self._layout, anchor, self._comp,
                                          self._key)
    self._anchor, self._outer_state = anchor, outer_state
    self._residual = jnp.zeros((self._plan.n,), jnp.float32)
    self._encode, decode_mean, self._outer_step = _shares.jitted(
        self._layout, self._plan, held_plan, self._comp,
        _outer.feedback_for(self._ef), self._outer)
    self._decode_mean = _exchange.Decoders(decode_mean, self._plan.payload,
                                           self._key)
    self.exchange_bytes = 0  # passed to the process group (each swap's buffer once), in all
    self.gather_bytes = 0  # gathered inside the island at the last sync
    # Compiled before this island joins: its first sync is then no slower
    # than its peers', who wait for it at most ``timeout``.
    jax.block_until_ready((
        self._encode(anchor, anchor, self._residual, self._key),
        self._outer_step(anchor, outer_state,
                         jnp.zeros((held_plan.n,), jnp.float32))))
    self.healed = False  # whether the last begin() healed from a peer
    self.heal_seconds = 0.0  # the last heal's wall time, s
    self.heal_bytes = 0  # the last heal's anchor and outer state, bytes
    self.restored_step: int | None = None  # step restored from Orbax at start

    self._ckpt = (AnchorCheckpoints(checkpoint_dir, island) if checkpoint_dir
                  else None)
    restored = self._restore() if self._ckpt else None
    self._store, self._pg, self._manager = _manager(
        island, lighthouse, state_dict=self._state_dict,
        load_state_dict=self._load_state_dict, min_islands=min_islands,
        timeout=timeout, quorum_timeout=quorum_timeout,
        connect_timeout=connect_timeout, hostname=hostname,
        store_host=store_host)
    if restored is not None:
      self._manager.load_state_dict({"step": restored,
                                     "batches_committed": 0})
    self._last_commit = time.monotonic()

  # -- the anchor, as torchft's state_dict hooks carry it ----------------

  @property
  def step(self) -> int:
    """Outer steps committed (torchft's step)."""
    return int(self._manager.current_step())

  @property
  def anchor(self):
    """The synchronized parameters (identical on every island at a
    step): leaves given sharded over the island's processes as global
    arrays of that sharding, the others as host-local arrays."""
    return _shares.to_params(self._layout, self._anchor)

  @property
  def outer_state(self):
    return self._outer_state

  @property
  def residual(self) -> jax.Array:
    """This process's error-feedback residual, float32: its share of the
    buffer (``(n,)`` in a one-process island)."""
    return self._residual

  def _state_dict(self) -> dict:
    torch = _torch().torch
    leaves = jax.tree.leaves((self._anchor, self._outer_state))
    return {"fingerprint": self.fingerprint,
            "description": json.dumps(self._description),
            "leaves": [torch.from_numpy(to_bytes(x).copy()) for x in leaves]}

  def _load_state_dict(self, sd: dict) -> None:
    """A heal: the anchor from a peer. Raises ElasticConfigError when the
    peer's configuration is not this island's."""
    if sd.get("fingerprint") != self.fingerprint:
      theirs = json.loads(sd.get("description", "{}"))
      raise ElasticConfigError(
          f"island {self.island!r} cannot join: the quorum trains another "
          f"model or configuration ({differences(self._description, theirs)})."
          " Start it with the same parameters, compressor and config.")
    like = jax.tree.leaves((self._anchor, self._outer_state))
    leaves = [jnp.asarray(from_bytes(t.numpy(), np.shape(x),
                                     np.asarray(x).dtype))
              for t, x in zip(sd["leaves"], like)]
    treedef = jax.tree.structure((self._anchor, self._outer_state))
    self._anchor, self._outer_state = jax.tree.unflatten(treedef, leaves)
    # A residual is what this island has not sent: a joiner has none.
    self._residual = jnp.zeros((self._plan.n,), jnp.float32)
    self.healed = True

  # -- Orbax ---------------------------------------------------------------

  def _save(self, step: int) -> None:
    if self._ckpt is not None:
      residual = self._residual
      if self._layout.processes > 1:  # the whole buffer's, from the shares
        shares, _ = _shares.gather(self._layout, residual, True)
        residual = _shares.whole_residual(self._layout, shares)
      self._ckpt.save(step, {"anchor": self._anchor,
                             "outer_state": self._outer_state,
                             "residual": residual},
                      self.fingerprint, self._description)

  def _restore(self) -> int | None:
    """Restores the newest anchor of any island under ``checkpoint_dir``;
    returns its step, or None when there is none."""
    assert self._ckpt is not None
    whole = sum(math.prod(s) for s in self._layout.shapes)
    found = self._ckpt.restore_newest(
        self.fingerprint, self._description,
        {"anchor": self._anchor, "outer_state": self._outer_state,
         "residual": np.zeros((whole,), np.float32)})
    if found is None:
      return None
    step, name, state = found
    self._anchor = jax.tree.map(jnp.asarray, state["anchor"])
    self._outer_state = jax.tree.map(jnp.asarray, state["outer_state"])
    # Another island's residual is not ours (see _load_state_dict).
    self._residual = (
        jnp.asarray(_shares.own_residual(self._layout, state["residual"]))
        if name == self.island else jnp.zeros((self._plan.n,), jnp.float32))
    self.restored_step = step
    return step

  # -- the loop --------------------------------------------------------------

  def _check_deadline(self) -> None:
    idle = time.monotonic() - self._last_commit
    if idle > self._quorum_timeout:
      raise QuorumError(
          f"island {self.island!r}: no commit for {idle:.0f} s (> "
          f"quorum_timeout={self._quorum_timeout:.0f} s): fewer islands "
          "than min_islands, or none reachable; the last anchor (step "
          f"{self.step}) is kept" + (" and checkpointed" if self._ckpt
                                     else ""))

  def _quorum(self) -> ElasticConfigError | None:
    """torchft's quorum (blocking; heals this island if it is behind).
    Returns a refused heal's ElasticConfigError, else None."""
    try:
      self._manager.start_quorum()
    except ElasticConfigError as e:
      return e
    except Exception as e:  # torchft raises the RPC's error on a timeout
      self._check_deadline()
      raise QuorumError(f"island {self.island!r}: no quorum: {e}") from e
    return None

  def begin(self):
    """Starts an interval: torchft's quorum (blocking), which heals this
    island from a peer if it is behind (:attr:`healed`; then
    :attr:`heal_seconds`, the quorum and transfer's wall time in seconds,
    and :attr:`heal_bytes`, the anchor's and outer state's bytes
    received), and the handshake with the quorum's other islands. Before
    the run's first commit a quorum of fewer than ``wait_for`` islands is
    asked again. Returns the anchor to start the interval's inner steps
    from.

    Raises:
      ElasticConfigError: this island's heal was refused (the quorum has
        another configuration; the others go on without it), or a peer
        that is not healing has another configuration (raised on every
        island of the quorum).
      QuorumError: no quorum for ``quorum_timeout`` seconds.
    """
    while True:
      self.healed = False
      t0 = time.monotonic()
      refused = self._quorum()
      if (refused is not None or self.step > 0
          or self._manager.num_participants() >= self._wait_for):
        break
      self._check_deadline()
      time.sleep(_WAIT_POLL_S)
    self._handshake(refused is not None)
    if refused is not None:
      raise refused
    if self.healed:
      self.heal_seconds = time.monotonic() - t0
      self.heal_bytes = sum(to_bytes(x).size for x in jax.tree.leaves(
          (self._anchor, self._outer_state)))
    return self.anchor

  @property
  def islands(self) -> int:
    """Islands in the current exchange (the quorum's but refused ones)."""
    return len(self._ranks) or int(self._manager.num_participants())

  def _swap(self, buf: np.ndarray, ranks: list[int], tag: int):
    self.exchange_bytes += buf.nbytes
    return _exchange.swap(_torch().torch, self._pg, buf,
                          self._manager.participating_rank(), ranks, tag,
                          self._timeout)

  def _fail(self, error: Exception) -> None:
    """A failed handshake or exchange: reported to torchft (the interval is
    discarded), and the group aborted, so a peer waiting on this island
    fails now (a failed commit makes torchft's next group anew)."""
    self._manager.report_error(error)
    self._ranks = []
    self._pg.abort()

  def _handshake(self, refused: bool) -> None:
    """Swaps the 48-byte header (fingerprint, payload length, refused)
    with every island of the quorum and keeps the ranks of the exchange:
    this island's fingerprint, not refused. A lost peer fails it
    (:meth:`_fail`).

    Raises:
      ElasticConfigError: a peer not refused has another configuration.
    """
    self._ranks = []
    header = _exchange.header(self.fingerprint, self._plan.payload_bytes,
                              refused)
    try:
      headers = self._swap(header, list(range(
          self._manager.num_participants())), _exchange.HANDSHAKE_TAG)
    except Exception as e:  # a lost peer: the interval is discarded
      self._fail(e)
      return
    if refused:
      return
    try:
      ranks = _exchange.exchange_ranks(headers, self.fingerprint,
                                       self._plan.payload_bytes, self.island)
    except ElasticConfigError as err:
      self._manager.report_error(err)
      raise
    self._ranks = ranks
    self._decode_mean.warm(len(ranks))

  def _exchange(self, local) -> tuple[Any, Any, jax.Array, int]:
    """Encodes this process's share, all-gathers it with the other
    islands', averages it, gathers the island's mean shares where its
    processes need them (:mod:`jaxcomp.elastic._shares`) and takes the
    outer step on the held blocks. Returns the new anchor, outer state and
    residual (not yet applied), and the payload's bytes."""
    mean, residual, nbytes, failure = None, None, 0, None
    try:
      mean, residual, nbytes = self._send(local)
    except Exception as e:  # raised after the island's gather, below
      failure = e
    mean, self.gather_bytes = _shares.island_mean(self._layout, mean,
                                                  failure, self.island)
    assert residual is not None  # island_mean raised otherwise
    anchor, outer_state = self._outer_step(self._anchor, self._outer_state,
                                           mean)
    jax.block_until_ready((anchor, outer_state, residual))
    return anchor, outer_state, residual, nbytes

  def _send(self, local) -> tuple[jax.Array, jax.Array, int]:
    """Encodes this process's share, all-gathers it with the same share of
    the other islands and decodes their mean. Returns the mean share
    (float32), the share's new residual and the payload's bytes."""
    key = jax.random.fold_in(self._key, self.step)
    if self._comp.randomness == "independent":
      # Each island its own draws, as compressed_mean's devices.
      key = jax.random.fold_in(key, self._manager.participating_rank() or 0)
    if self._layout.processes > 1:  # each share its own draws
      key = jax.random.fold_in(key, self._layout.index)
    payload, residual = self._encode(self._anchor, local, self._residual,
                                     key)
    buf = np.concatenate([to_bytes(p) for p in payload])
    bufs = self._swap(buf, self._ranks, _exchange.PAYLOAD_TAG)
    stacked, off = [], 0
    for s in self._plan.payload:
      nb = int(np.prod(s.shape)) * np.dtype(s.dtype).itemsize
      stacked.append(jnp.asarray(np.stack(
          [from_bytes(b[off:off + nb], s.shape, s.dtype) for b in bufs])))
      off += nb
    return self._decode_mean(stacked, key), residual, int(buf.size)

  def sync(self, local) -> SyncResult:
    """Ends an interval: exchanges ``anchor - local`` (compressed, with
    error feedback), averages it over the islands present and takes the
    outer step, then asks torchft whether to commit. Only on commit are
    the anchor, outer state, residual and step replaced (and the anchor
    checkpointed); otherwise all stay as they were.

    Args:
      local: this island's parameters after the interval's inner steps,
        the anchor's structure, shapes and dtypes (in a multi-process
        island, global arrays, replicated over its processes or sharded
        as the ``params`` given at construction).

    Returns:
      A :class:`SyncResult`; continue from its ``params``.

    Raises:
      QuorumError: no commit for ``quorum_timeout`` seconds.
    """
    t0 = time.monotonic()
    local = _shares.held(self._layout, local)
    islands = self.islands
    new, error, nbytes = None, None, 0
    if self._manager.errored() is None and self._ranks:
      try:
        *new, nbytes = self._exchange(local)
      except Exception as e:  # a lost peer, a timeout: discard the interval
        error = e
        self._fail(e)
    else:
      error = self._manager.errored()
      if self._layout.needs_gather:  # the island's other processes wait
        _shares.gather(self._layout, None, False)
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

  Raises:
    ImportError: without torch and torchft (``pip install
      "jaxcomp[elastic]"``).
  """
  return _torch().coordination.LighthouseServer(
      bind=bind, min_replicas=min_replicas, join_timeout_ms=join_timeout_ms,
      quorum_tick_ms=quorum_tick_ms, heartbeat_timeout_ms=heartbeat_timeout_ms)

