"""What every part of :mod:`jaxcomp.elastic` shares: its errors, a sync's
result, the configuration's fingerprint and the leaves' bytes. No torch
here."""

from __future__ import annotations

import hashlib
import json
import os
import socket
from typing import Any, NamedTuple

import jax
import numpy as np


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
    bytes_sent: this process's payload (its share of the island's),
      bytes (header not counted).
    error: the exception that made the sync fail, or None.
  """

  committed: bool
  islands: int
  step: int
  params: Any
  seconds: float
  bytes_sent: int
  error: BaseException | None


def describe(params, outer_state, compressor, error_feedback: bool,
             config) -> dict:
  """The configuration every island must share (JSON-able)."""
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  o_leaves, o_treedef = jax.tree.flatten(outer_state)
  return {
      "params": [[jax.tree_util.keystr(p), list(np.shape(x)),
                  str(np.dtype(x.dtype) if hasattr(x, "dtype")
                      else np.asarray(x).dtype)] for p, x in leaves],
      "params_tree": str(treedef),
      "outer_state": [[list(np.shape(x)), str(np.asarray(x).dtype)]
                      for x in o_leaves],
      "outer_state_tree": str(o_treedef),
      "compressor": repr(compressor),
      "error_feedback": bool(error_feedback),
      "config": json.loads(json.dumps(config or {}, sort_keys=True,
                                      default=str)),
  }


def fingerprint(description: dict) -> str:
  """sha256 (hex) of a :func:`describe` result."""
  return hashlib.sha256(json.dumps(description, sort_keys=True)
                        .encode()).hexdigest()


def differences(mine: dict, theirs: dict) -> str:
  """The keys where two descriptions differ, both values named."""
  keys = sorted(k for k in set(mine) | set(theirs)
                if mine.get(k) != theirs.get(k))
  return "; ".join(f"{k}: this island {mine.get(k)!r}, peer "
                   f"{theirs.get(k)!r}" for k in keys) or "(same description)"


def to_bytes(x) -> np.ndarray:
  """A leaf's bytes as a flat uint8 array (any dtype, bfloat16 included)."""
  return np.ascontiguousarray(np.asarray(x)).reshape(-1).view(np.uint8)


def from_bytes(buf: np.ndarray, shape, dtype) -> np.ndarray:
  """The inverse of :func:`to_bytes`: ``buf`` read as ``dtype`` in
  ``shape``."""
  return np.frombuffer(buf.tobytes(), dtype=np.dtype(dtype)).reshape(shape)


def digest(tree) -> str:
  """sha256 of a pytree's leaves' bytes (in ``jax.tree.leaves`` order):
  equal digests mean bitwise equal leaves."""
  h = hashlib.sha256()
  for x in jax.tree.leaves(tree):
    h.update(to_bytes(x).tobytes())
  return h.hexdigest()


def own_address() -> str:
  """This machine's hostname resolved to an address (what peers dial): the
  hostname itself would resolve to each peer's own address where every
  network namespace maps it to its veth (``/etc/netns/NAME/hosts``)."""
  name = socket.gethostname()
  try:
    return socket.gethostbyname(name)
  except OSError:
    return name


def check_names(island: str | None, lighthouse: str | None,
                 min_islands: int, wait_for: int | None
                 ) -> tuple[str, str, int]:
  """The island's name, the Lighthouse's address and ``wait_for``, from
  the arguments or ``JAXCOMP_ISLAND``, ``JAXCOMP_LIGHTHOUSE``,
  ``JAXCOMP_WAIT_FOR``.

  Raises:
    ValueError: no Lighthouse, a bad name, a count below 1.
  """
  island = island or os.environ.get("JAXCOMP_ISLAND", "")
  lighthouse = lighthouse or os.environ.get("JAXCOMP_LIGHTHOUSE")
  if wait_for is None:
    wait_for = int(os.environ.get("JAXCOMP_WAIT_FOR", "1"))
  if not lighthouse:
    raise ValueError("lighthouse not given and JAXCOMP_LIGHTHOUSE not set: "
                     "pass the Lighthouse's address, e.g. "
                     "'http://host:29510'")
  if not island or "/" in island or ":" in island:
    raise ValueError(f"island must be a non-empty name without '/' or "
                     f"':', got {island=!r}")
  if min_islands < 1 or wait_for < 1:
    raise ValueError(f"min_islands and wait_for must be >= 1, got "
                     f"{min_islands=}, {wait_for=}")
  return island, lighthouse, wait_for
