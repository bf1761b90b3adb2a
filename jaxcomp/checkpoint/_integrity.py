"""Each process's record of the files it wrote for a step (sizes and
BLAKE2b digests), against which a damaged checkpoint is found before any
array is read."""

from __future__ import annotations

import hashlib
import os


class CheckpointDamagedError(RuntimeError):
  """A checkpoint's files are missing or not as they were written (a
  process's shard deleted or truncated)."""


_INTEGRITY = "jaxcomp_integrity"  # per step: process_<i>.json, each file's
#                                   size and content digest


def _digest_file(path: str) -> str:
  """A 128-bit BLAKE2b digest of the file's bytes (hex)."""
  h = hashlib.blake2b(digest_size=16)
  with open(path, "rb") as f:
    for chunk in iter(lambda: f.read(1 << 20), b""):
      h.update(chunk)
  return h.hexdigest()


def _owner(rel: str) -> int:
  """The process whose data a file of Orbax's layout is (``..process_<i>``
  in its path); shared files are process 0's."""
  for part in rel.split(os.sep):
    head, sep, index = part.rpartition("process_")
    if sep and index.isdigit():
      return int(index)
  return 0


def _listing(step_dir: str, process: int) -> dict[str, int]:
  """``{path: bytes}`` of the files of ``process``'s data in a step."""
  out = {}
  for root, _, files in os.walk(step_dir):
    for f in files:
      rel = os.path.relpath(os.path.join(root, f), step_dir)
      if not rel.startswith(_INTEGRITY) and _owner(rel) == process:
        out[rel] = os.path.getsize(os.path.join(step_dir, rel))
  return out


def _record(step_dir: str, process: int) -> dict[str, list]:
  """``{path: [bytes, digest]}`` of the files of ``process``'s data in a
  step: what :meth:`Checkpointer.save` records and :meth:`damage` checks
  (a size alone let a file overwritten with other bytes of the same length
  pass, and restore other values or fail inside Orbax)."""
  return {rel: [size, _digest_file(os.path.join(step_dir, rel))]
          for rel, size in _listing(step_dir, process).items()}
