"""The autotuning decisions and their cache file: what a decision covers
(:class:`TuneKey`), the decision itself (:class:`Decision`) and the JSON file
that keeps them (:class:`CacheFile`), for :mod:`jaxcomp.kernels._autotune`.

The cache file (default ``$XDG_CACHE_HOME/jaxcomp/autotune.json``, else
``~/.cache/jaxcomp/autotune.json``) holds one table per device kind, JAX,
jaxlib and jaxcomp version; a lookup reads only the table of the running
versions, so an upgrade measures again. A file that cannot be read as a cache
is ignored with a warning (and replaced by the next measurement). Writers
take a lock (``fcntl.flock`` on ``<path>.lock``) and replace the file
atomically, merging what other processes wrote meanwhile.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.metadata
import json
import os
import tempfile
import warnings
from collections.abc import Mapping

import jax

try:
  import fcntl
except ImportError:  # not POSIX: the atomic replace alone keeps the file whole
  fcntl = None


# What a caller names as ``implementation=`` ("pallas": the op's default
# Pallas kernel), and the candidates the autotuner times where an op offers
# them: XLA, the Mosaic GPU kernel, the kernel lowered by Triton. A decision
# is one of CHOICES ("pallas" where JAXCOMP_KERNELS=pallas forced it).
IMPLEMENTATIONS = ("pallas", "xla")
CANDIDATES = ("xla", "mosaic", "triton")
CHOICES = ("pallas", "xla", "mosaic", "triton")
# The autotuning cache file's path ("~" expanded), read at each lookup:
# unset or empty for the default ($XDG_CACHE_HOME/jaxcomp/autotune.json, else
# ~/.cache/jaxcomp/autotune.json), or "none" (any case) for no file: the
# decisions are kept in memory only. An Autotuner given its own cache_path
# does not read it.
ENV_CACHE = "JAXCOMP_AUTOTUNE_CACHE"
CACHE_FORMAT = 1


def size_class(n: int) -> int:
  """``c`` with ``2**(c-1) < n <= 2**c`` (0 for ``n <= 1``): the sizes that
  share one autotuning decision."""
  return max(0, (int(n) - 1).bit_length())


@dataclasses.dataclass(frozen=True)
class TuneKey:
  """What one autotuning decision covers (see
  :mod:`jaxcomp.kernels._autotune`).

  Attributes:
    op: ``"sign"``, ``"qsgd"``, ``"int8"``, ``"fp8"``, ``"topk"`` or
      ``"sampled_topk"``.
    dtype: the input's dtype name, e.g. ``"float32"``.
    size_class: ``c`` of :func:`size_class`: ``2**(c-1) < n <= 2**c``.
    params: sorted ``(name, value)`` pairs of the parameters that change
      the kernel, values as strings.
  """
  op: str
  dtype: str
  size_class: int
  params: tuple[tuple[str, str], ...] = ()

  def __str__(self) -> str:
    parts = [self.op, self.dtype, f"n<=2^{self.size_class}"]
    return " ".join(parts + [f"{k}={v}" for k, v in self.params])



@dataclasses.dataclass(frozen=True)
class Decision:
  """One implementation choice and where it came from.

  Attributes:
    key: what it covers.
    implementation: one of ``CHOICES``: a measured candidate
      (``"xla"``, ``"mosaic"``, ``"triton"``) or ``"pallas"`` (forced).
    source: ``"measured"``, ``"cache file"``, ``"process 0"`` (another
      process of the job), or ``"not timed: <reason>"``.
    seconds: measured seconds per call of each implementation (None for
      one that failed); empty where nothing was timed here.
    errors: the first line of each failed implementation's error.
    n: the size that was timed (0 where nothing was).
    device: the device kind.
    when: UTC time of the measurement, ISO 8601.
  """
  key: TuneKey
  implementation: str
  source: str
  seconds: Mapping[str, float | None] = dataclasses.field(default_factory=dict)
  errors: Mapping[str, str] = dataclasses.field(default_factory=dict)
  n: int = 0
  device: str = ""
  when: str = ""

  def to_json(self) -> dict:
    return {"implementation": self.implementation, "seconds": dict(self.seconds),
            "errors": dict(self.errors), "n": self.n, "when": self.when}

  @classmethod
  def from_json(cls, key: TuneKey, device: str, entry: Mapping) -> Decision:
    implementation = entry["implementation"]
    if implementation not in CHOICES:
      raise ValueError(f"implementation {implementation!r}")
    return cls(key=key, implementation=implementation, source="cache file",
               seconds=dict(entry.get("seconds", {})),
               errors=dict(entry.get("errors", {})), n=int(entry.get("n", 0)),
               device=device, when=str(entry.get("when", "")))

  def describe(self) -> str:
    """One line: the key, the choice, and the times behind it."""
    times = ", ".join(
        f"{impl} {'failed' if s is None else f'{s * 1e3:.4f} ms'}"
        for impl, s in sorted(self.seconds.items()))
    detail = self.source + (f": {times}" if times else "")
    if self.n:
      detail += f" at n={self.n:,}"
    return f"{self.key} on {self.device}: {self.implementation} ({detail})"


def _version(package: str) -> str:
  try:
    return importlib.metadata.version(package)
  except importlib.metadata.PackageNotFoundError:
    return "unknown"


def environment_versions() -> dict[str, str]:
  """The versions that key a cache table: JAX, jaxlib and jaxcomp (read
  from the installed distributions: this package imports nothing of
  jaxcomp)."""
  return {"jax": jax.__version__, "jaxlib": _version("jaxlib"),
          "jaxcomp": _version("jaxcomp")}


def default_cache_path() -> str | None:
  """``$JAXCOMP_AUTOTUNE_CACHE`` (None where it is ``none``), else
  ``$XDG_CACHE_HOME/jaxcomp/autotune.json`` or
  ``~/.cache/jaxcomp/autotune.json``."""
  path = os.environ.get(ENV_CACHE)
  if path is not None and path.strip():
    return None if path.strip().lower() == "none" else os.path.expanduser(path)
  base = os.environ.get("XDG_CACHE_HOME") or os.path.join(
      os.path.expanduser("~"), ".cache")
  return os.path.join(base, "jaxcomp", "autotune.json")


class CacheFile:
  """The JSON file of autotuning decisions:
  ``{"format": 1, "tables": {table: {str(key): entry}}}``, one table per
  device kind and versions
  (:meth:`jaxcomp.kernels.Autotuner.table_name`)."""

  def __init__(self, path: str):
    self.path = path
    self._warned = False

  def _load(self) -> dict:
    """The file's tables; {} for a missing file, and for an unreadable one
    (with a warning, once)."""
    try:
      with open(self.path, encoding="utf-8") as f:
        data = json.load(f)
      if (not isinstance(data, dict) or data.get("format") != CACHE_FORMAT
          or not isinstance(data.get("tables"), dict)
          or not all(isinstance(t, dict) for t in data["tables"].values())):
        raise ValueError(f"not a format-{CACHE_FORMAT} autotuning cache")
      return data["tables"]
    except FileNotFoundError:
      return {}
    except (OSError, ValueError) as e:  # json.JSONDecodeError is a ValueError
      if not self._warned:
        self._warned = True
        warnings.warn(
            f"jaxcomp.kernels: the autotuning cache {self.path} cannot be "
            f"read ({type(e).__name__}: {e}); it is ignored, and the next "
            "measurement replaces it. Set JAXCOMP_AUTOTUNE_CACHE to use "
            "another file.", RuntimeWarning, stacklevel=4)
      return {}

  def read(self, table: str) -> dict[str, dict]:
    """The entries of ``table`` (``{str(key): entry}``)."""
    return dict(self._load().get(table, {}))

  @contextlib.contextmanager
  def _locked(self):
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    if fcntl is None:
      yield
      return
    with open(self.path + ".lock", "a", encoding="utf-8") as lock:
      fcntl.flock(lock, fcntl.LOCK_EX)
      try:
        yield
      finally:
        fcntl.flock(lock, fcntl.LOCK_UN)

  def write(self, table: str, key: str, entry: Mapping) -> None:
    """Adds ``entry`` under ``key`` of ``table``, keeping every other entry
    the file holds now (read under the lock), and replaces the file
    atomically."""
    with self._locked():
      tables = self._load()
      tables.setdefault(table, {})[key] = dict(entry)
      folder = os.path.dirname(os.path.abspath(self.path))
      fd, tmp = tempfile.mkstemp(prefix=".autotune.", suffix=".json",
                                 dir=folder)
      try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
          json.dump({"format": CACHE_FORMAT, "tables": tables}, f, indent=1,
                    sort_keys=True)
        os.replace(tmp, self.path)
      except BaseException:
        with contextlib.suppress(OSError):
          os.unlink(tmp)
        raise

