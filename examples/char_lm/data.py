"""A character-level corpus: the CPython standard library's own source code.

Every machine with Python has it, so the example needs no download. The files
are the ``*.py`` files directly in the directory of the ``os`` module
(``sysconfig.get_paths()["stdlib"]``), read as bytes in sorted order; every
``HELD_OUT_EVERY``-th file (sorted index ``% HELD_OUT_EVERY == 0``) is held out
for validation. The vocabulary is the 256 byte values, so one "character" is
one byte (the standard library is almost entirely ASCII, where the two agree)
and no file needs to be decoded.

The corpus differs between Python versions: compare numbers only between runs
on the same interpreter (``Corpus.python_version`` says which).
"""

from __future__ import annotations

import glob
import os
import platform
import sysconfig
from typing import NamedTuple

import numpy as np

VOCAB_SIZE = 256  # byte values
HELD_OUT_EVERY = 10
SEPARATOR = b"\n\n"  # between concatenated files


class Corpus(NamedTuple):
  train: np.ndarray  # (N,) int32 byte values of the training files
  valid: np.ndarray  # (M,) int32 byte values of the held-out files
  train_files: tuple[str, ...]  # base names, sorted
  valid_files: tuple[str, ...]
  python_version: str


def stdlib_dir() -> str:
  """The directory of the ``os`` module (the pure-Python standard library)."""
  return sysconfig.get_paths()["stdlib"]


def source_files(directory: str | None = None) -> list[str]:
  """Sorted paths of the ``*.py`` files directly in ``directory``.

  Raises:
    FileNotFoundError: no ``*.py`` file there.
  """
  directory = directory or stdlib_dir()
  files = sorted(glob.glob(os.path.join(directory, "*.py")))
  if not files:
    raise FileNotFoundError(f"no *.py files in {directory!r}")
  return files


def split_files(files: list[str]) -> tuple[list[str], list[str]]:
  """(train, held-out): every ``HELD_OUT_EVERY``-th file of the sorted list
  is held out."""
  if len(files) < 2:
    raise ValueError(f"need at least 2 files to hold one out, got {len(files)}")
  valid = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY == 0]
  train = [f for i, f in enumerate(files) if i % HELD_OUT_EVERY != 0]
  return train, valid


def _read(paths: list[str], max_bytes: int | None) -> np.ndarray:
  chunks, total = [], 0
  for path in paths:
    with open(path, "rb") as f:
      chunks.append(f.read() + SEPARATOR)
    total += len(chunks[-1])
    if max_bytes is not None and total >= max_bytes:
      break
  data = b"".join(chunks)
  if max_bytes is not None:
    data = data[:max_bytes]
  return np.frombuffer(data, np.uint8).astype(np.int32)


def load(directory: str | None = None, *, max_train_bytes: int | None = None,
         max_valid_bytes: int | None = None) -> Corpus:
  """Reads the corpus (deterministic: the same files give the same arrays).

  Args:
    directory: where the ``*.py`` files are; the standard library by default.
    max_train_bytes: keep only the first bytes of the training stream.
    max_valid_bytes: keep only the first bytes of the validation stream.
  """
  train, valid = split_files(source_files(directory))
  return Corpus(_read(train, max_train_bytes), _read(valid, max_valid_bytes),
                tuple(os.path.basename(f) for f in train),
                tuple(os.path.basename(f) for f in valid),
                platform.python_version())


def random_windows(stream: np.ndarray, batch: int, length: int,
                   rng: np.random.Generator) -> np.ndarray:
  """``batch`` windows of ``length`` consecutive bytes at random offsets.

  Returns:
    int32 array of shape ``(batch, length)``.
  """
  if len(stream) <= length:
    raise ValueError(f"stream of {len(stream)} bytes is too short for "
                     f"windows of {length=}")
  starts = rng.integers(0, len(stream) - length, size=batch)
  return stream[starts[:, None] + np.arange(length)[None, :]]


def fixed_windows(stream: np.ndarray, count: int, length: int) -> np.ndarray:
  """``count`` evenly spaced, non-overlapping windows (the validation set).

  Returns:
    int32 array of shape ``(min(count, len(stream) // length), length)``.
  """
  count = min(count, len(stream) // length)
  if count < 1:
    raise ValueError(f"stream of {len(stream)} bytes is too short for "
                     f"windows of {length=}")
  stride = len(stream) // count
  starts = np.arange(count) * stride
  return stream[starts[:, None] + np.arange(length)[None, :]]
