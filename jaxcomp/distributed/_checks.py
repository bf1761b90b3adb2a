"""Cross-process checks: the processes were started with the same
configuration (:func:`check_agreement`) and hold identical copies of what
must be replicated (:func:`check_consistency`)."""

from __future__ import annotations

import hashlib

import jax
import jax.numpy as jnp
import numpy as np


class ConsistencyError(RuntimeError):
  """Processes or devices hold different values of a leaf that must be
  identical everywhere (parameters, shared compressor state)."""


class AgreementError(ConsistencyError):
  """The processes of a job were started with different configurations (a
  transform hyperparameter, a state shape, the mesh): found before the first
  exchange, instead of a collective that aborts or silently diverges."""


_AGREEMENT_SLOTS = 256  # items compared one by one; the rest as one digest


def check_agreement(items, *, what: str = "configuration") -> int:
  """Checks that every process has the same ``items``, with one small
  all-gather (``(_AGREEMENT_SLOTS + 1) x 16`` bytes per process).

  Every process must call it with a list of the same length and order
  (``(name, value)`` pairs, value a string); a process with another length
  is a difference too.

  Returns:
    The number of items compared.

  Raises:
    AgreementError: on every process, naming the first item whose value
      differs, this process's value, and which processes differ from it.
  """
  items = [(str(k), str(v)) for k, v in items]
  slots = np.zeros((_AGREEMENT_SLOTS + 1, 4), np.uint32)
  slots[0, 0] = len(items)
  rest = hashlib.blake2b(digest_size=16)
  for i, (k, v) in enumerate(items):
    h = np.frombuffer(hashlib.blake2b(f"{k}={v}".encode(), digest_size=16)
                      .digest(), np.uint32)
    if i < _AGREEMENT_SLOTS:
      slots[1 + i] = h
    else:
      rest.update(h.tobytes())
  if len(items) > _AGREEMENT_SLOTS:
    slots[_AGREEMENT_SLOTS] = np.frombuffer(rest.digest(), np.uint32)
  if jax.process_count() == 1:
    return len(items)
  from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
  every = np.asarray(multihost_utils.process_allgather(slots))
  me = jax.process_index()
  for row in range(slots.shape[0]):
    differ = [p for p in range(every.shape[0])
              if not np.array_equal(every[p, row], every[me, row])]
    if not differ:
      continue
    if row == 0:
      raise AgreementError(
          f"process {me} has {len(items)} {what} items, processes {differ} "
          "another number: the processes were started with different "
          "models or transforms; start every process with the same "
          "configuration")
    name, value = (items[row - 1] if row <= min(len(items), _AGREEMENT_SLOTS)
                   else ("the items after the first "
                         f"{_AGREEMENT_SLOTS}", "..."))
    raise AgreementError(
        f"the processes disagree on their {what}: {name} is {value} on "
        f"process {me} but differs on processes {differ}. Start every "
        "process with the same configuration (a difference here would "
        "otherwise crash a collective or let the processes diverge)")
  return len(items)


def _path_str(path) -> str:
  return jax.tree_util.keystr(path) or "<root>"


def _digest(x: np.ndarray) -> np.ndarray:
  x = np.ascontiguousarray(x)
  h = hashlib.blake2b(x.tobytes(), digest_size=16)
  h.update(str((x.shape, x.dtype.str)).encode())
  return np.frombuffer(h.digest(), dtype=np.uint32).copy()


def _host_value(shard) -> np.ndarray:
  data = shard.data
  if jnp.issubdtype(data.dtype, jax.dtypes.prng_key):
    data = jax.random.key_data(data)
  return np.asarray(data)


def check_consistency(tree, *, name: str = "state") -> int:
  """Checks that every replicated leaf is identical on all devices and
  processes.

  Call it (opt-in, e.g. every N steps) on ``{"params": params, "opt_state":
  opt_state}``: parameters, the inner optimizer's moments and the shared
  compressor state (shared PRNG key, PowerSGD Q, counts) are replicated
  (``P()``) and must be bit-identical everywhere; a difference means the
  processes diverged. Per-device leaves (error-feedback residuals, sharded
  with ``P(axes)``) legitimately differ and are skipped.

  Every process must call it (it exchanges one 16-byte digest per leaf
  between processes).

  Args:
    tree: a pytree of global arrays (``jax.Array``).
    name: how to call ``tree`` in error messages.

  Returns:
    The number of leaves checked.

  Raises:
    ConsistencyError: naming the first leaf (by tree path) whose copies
      differ, and the processes or devices holding the differing copies.
  """
  flat = [(p, x) for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]
          if isinstance(x, jax.Array) and x.sharding.is_fully_replicated]
  digests = np.zeros((len(flat), 4), np.uint32)
  for i, (path, x) in enumerate(flat):
    shards = sorted(x.addressable_shards, key=lambda s: s.device.id)
    local = [_digest(_host_value(s)) for s in shards]
    for s, d in zip(shards[1:], local[1:]):
      if not np.array_equal(d, local[0]):
        raise ConsistencyError(
            f"{name}{_path_str(path)} differs between devices "
            f"{shards[0].device} and {s.device} of process "
            f"{jax.process_index()}; replicated values must be identical on "
            "every device")
    digests[i] = local[0]
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    every = np.asarray(multihost_utils.process_allgather(digests))
  else:
    every = digests[None]
  for i, (path, _) in enumerate(flat):
    groups: dict[bytes, list[int]] = {}
    for proc in range(every.shape[0]):
      groups.setdefault(every[proc, i].tobytes(), []).append(proc)
    if len(groups) > 1:
      parts = "; ".join(f"value {j} on processes {procs}"
                        for j, procs in enumerate(groups.values()))
      raise ConsistencyError(
          f"{name}{_path_str(path)} diverged across processes: {len(groups)} "
          f"different values ({parts}). Parameters and "
          "shared compressor state must be identical on every process; "
          "check that every process feeds the same global batch, seed and "
          "configuration")
  return len(flat)
