"""Which implementation of a kernel op runs: the one the caller names
(``"pallas"`` or ``"xla"``), the one the environment forces, or, with
``implementation=None`` on an NVIDIA GPU, the fastest of the op's
candidates measured on that GPU (autotuning): XLA, the Mosaic GPU kernel
and the kernel lowered by Triton, where the op has each
(``jaxcomp.kernels.CANDIDATES``), as Triton autotunes a
kernel per shape and XLA measures its cuBLAS / cuDNN candidates while it
compiles.

Autotuning. The first time a trace asks for an op with ``implementation=None``
at a :class:`TuneKey` (op, dtype, size class ``2**(c-1) < n <= 2**c`` and
the parameters that change the kernel: code width, bucket / block size,
rounding, whether ``x`` is read in place), the :class:`Autotuner` times every
candidate the op offers for those parameters on a scratch buffer of that
size on the local GPU (a compile and warm call, then 5 trials of at least 1
ms of back-to-back calls; the median per call), takes the fastest (a kernel
that fails to compile or run loses, e.g. Mosaic GPU kernels on a GPU before
Hopper; XLA must run), and keeps the choice in
memory and in a JSON cache file. The size is static, so the choice is made
before tracing goes on. Off NVIDIA GPUs nothing is timed: XLA.

The cache file and the records in it: :mod:`jaxcomp.kernels._autotune_cache`.

Processes of one job (``jax.process_count() > 1``) agree: process 0 decides
(from its cache or by measuring) and broadcasts each choice over the job's
devices (``jax.experimental.multihost_utils.broadcast_one_to_all``, at trace
time); the other processes wait for it in that broadcast and never read
their own cache file or measure, so every process traces the same program.

Environment (read at trace time, so set it before the first trace):

* ``JAXCOMP_KERNELS``: ``autotune`` (default), ``xla`` (autotuning off: XLA
  for every op), or ``pallas`` (the Pallas kernels for every op whose
  parameters they take; an error off NVIDIA GPUs). An ``implementation``
  named by the caller wins over it.
* ``JAXCOMP_AUTOTUNE_CACHE``: the cache file's path, or ``none`` for no file
  (memory only).

Every choice is logged once per key and process on the ``jaxcomp.kernels``
logger (``logging.INFO``).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import datetime
import logging
import math
import os
import statistics
import threading
import time
import warnings
from typing import Any, cast
from collections.abc import Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental import multihost_utils

from . import _launch
from ._autotune_cache import CHOICES
from ._autotune_cache import CacheFile
from ._autotune_cache import Decision
from ._autotune_cache import IMPLEMENTATIONS
from ._autotune_cache import TuneKey
from ._autotune_cache import default_cache_path
from ._autotune_cache import environment_versions
from ._autotune_cache import size_class

logger = logging.getLogger("jaxcomp.kernels")

# Which implementation every kernel op with implementation=None takes, read
# at trace time: "autotune" (the default, also when unset or empty: measured
# per TuneKey on NVIDIA GPUs, XLA elsewhere), "xla" (autotuning off, XLA for
# every op) or "pallas" (the Pallas kernels for every op whose parameters
# they take, XLA for the others; a ValueError off NVIDIA GPUs). Case and
# surrounding spaces are ignored; any other value is a ValueError. An
# implementation named by the caller wins over it.
ENV_KERNELS = "JAXCOMP_KERNELS"
MODES = ("autotune", "xla", "pallas")


def _no_extras(x: jax.Array) -> tuple:
  del x
  return ()


@dataclasses.dataclass(frozen=True)
class Tunable:
  """An op call whose implementation is to be chosen, as the op's
  ``*_auto`` function describes it.

  Attributes:
    op: the op's name (:attr:`TuneKey.op`).
    n: element count of its input.
    dtype: its input's dtype.
    run: ``run(implementation, interpret)`` returns the op as a function
      ``f(x, *extras)`` of a scratch input ``x`` of ``n`` elements of
      ``dtype`` (and of ``extras(x)``), on that implementation (one of
      ``jaxcomp.kernels._autotune_cache.CHOICES``; ``interpret``: the
      Pallas kernels in interpret mode, for a simulated GPU on a CPU).
    params: the parameters that change the kernel (:attr:`TuneKey.params`).
    extras: the op's other operands for a scratch run (e.g. a seed), from
      the scratch ``x``.
    supported: whether the Pallas path takes these parameters (e.g. a
      bucket size that is a multiple of 32); if not, XLA, untimed.
    candidates: what is timed, in order (``"xla"`` among them): the names
      ``run`` takes, from ``jaxcomp.kernels._autotune_cache.CHOICES``.
  """
  op: str
  n: int
  dtype: Any
  run: Callable[[str, bool], Callable[..., Any]]
  params: Mapping[str, Any] = dataclasses.field(default_factory=dict)
  extras: Callable[[jax.Array], tuple] = _no_extras
  supported: bool = True
  candidates: tuple[str, ...] = ("pallas", "xla")

  @property
  def key(self) -> TuneKey:
    return TuneKey(op=self.op, dtype=jnp.dtype(self.dtype).name,
                   size_class=size_class(self.n),
                   params=tuple(sorted((str(k), str(v))
                                       for k, v in self.params.items())))


def candidates(*, mosaic: bool, triton: bool) -> tuple[str, ...]:
  """An op's candidates for :attr:`Tunable.candidates`: XLA, and the Mosaic
  GPU and Triton kernels where they take the call's parameters."""
  return (("xla",) + (("mosaic",) if mosaic else ())
          + (("triton",) if triton else ()))


Timer = Callable[[TuneKey, str, Callable[..., Any], tuple], float]


def measure_seconds(fn: Callable[..., Any], args: tuple, *, repeats: int = 5,
                    min_trial_seconds: float = 1e-3,
                    max_calls: int = 100) -> float:
  """Median seconds per call of ``jax.jit(fn)(*args)``: one call to compile
  and warm up, then ``repeats`` trials of back-to-back calls (as many as
  take ``min_trial_seconds``, at most ``max_calls``) waited for together.

  Raises:
    jax.errors.JaxRuntimeError: compiling or running ``fn`` failed in XLA
      (e.g. a Pallas kernel on a GPU that its lowering does not take).
    Exception: any other error of tracing ``fn`` (``TypeError``,
      ``ValueError``, ...). Nothing is caught here: each error reaches the
      caller as ``fn`` raised it (:class:`Autotuner` counts a Pallas path
      that raises as the slower one).
  """
  jitted = jax.jit(fn)
  jax.block_until_ready(jitted(*args))
  start = time.perf_counter()
  jax.block_until_ready(jitted(*args))
  one = time.perf_counter() - start
  calls = max(1, min(max_calls, math.ceil(min_trial_seconds / max(one, 1e-7))))
  trials = []
  for _ in range(repeats):
    start = time.perf_counter()
    jax.block_until_ready([jitted(*args) for _ in range(calls)])
    trials.append((time.perf_counter() - start) / calls)
  return statistics.median(trials)


def _default_timer(key: TuneKey, implementation: str, fn, args) -> float:
  del key, implementation
  return measure_seconds(fn, args)


def _process_0s_choice(implementation: str) -> str:
  """Process 0's ``implementation`` (one of ``CHOICES``), on every
  process of the job: one broadcast of its index over the job's devices
  (``jax.experimental.multihost_utils.broadcast_one_to_all``). It runs at
  once even while a program is being traced: in a thread of its own, whose
  JAX trace state is fresh (JAX keeps it per thread). Every process must
  call it at the same point: they do, tracing the same program."""
  def broadcast():
    return int(multihost_utils.broadcast_one_to_all(
        np.int32(CHOICES.index(implementation))))

  with concurrent.futures.ThreadPoolExecutor(1) as pool:
    return CHOICES[pool.submit(broadcast).result()]


class Autotuner:
  """Chooses among an op's candidates for ``implementation=None`` (see the
  module doc); one per process is the default (:func:`default_autotuner`),
  and :func:`use_autotuner` puts another in its place.

  Args:
    timer: ``timer(key, implementation, fn, args) -> seconds`` per call of
      ``fn(*args)``; default :func:`measure_seconds`. Tests inject one.
    cache_path: the cache file; default :func:`default_cache_path` (read
      at each lookup); ``"none"`` for memory only.
    device_kind: the GPU's name, e.g. ``"NVIDIA H100 80GB HBM3"``; default
      the first local device's ``device_kind``.
    nvidia: whether autotuning applies (an NVIDIA GPU backend); default
      ``jaxcomp.kernels.nvidia_gpu()``. True on a CPU simulates one (with
      ``interpret=True``, so that the Pallas candidates run).
    interpret: time the Pallas kernels in interpret mode (a simulated GPU).
    versions: ``{"jax", "jaxlib", "jaxcomp"}`` versions keying the cache
      table; default :func:`environment_versions`.
    agree: in a job of several processes, take process 0's choices (True,
      the default); False lets each process decide alone, which can make
      them compile different programs (for tests of the agreement).
  """

  def __init__(self, *, timer: Timer | None = None,
               cache_path: str | None = None, device_kind: str | None = None,
               nvidia: bool | None = None, interpret: bool = False,
               versions: Mapping[str, str] | None = None, agree: bool = True):
    self.timer = timer or _default_timer
    self._cache_path = cache_path
    self._device_kind = device_kind
    self._nvidia = nvidia
    self.interpret = interpret
    self.versions = dict(versions or environment_versions())
    self.agree = agree
    self._decisions: dict[TuneKey, Decision] = {}
    self._files: dict[str, CacheFile] = {}
    self._lock = threading.RLock()
    self._seen: list[list[Decision]] = []  # recorders of autotune()

  @property
  def nvidia(self) -> bool:
    return _launch.nvidia_gpu() if self._nvidia is None else self._nvidia

  @property
  def device_kind(self) -> str:
    if self._device_kind is None:
      device = jax.local_devices()[0]
      self._device_kind = str(getattr(device, "device_kind", device.platform))
    return self._device_kind

  @property
  def cache_path(self) -> str | None:
    if self._cache_path is None:
      return default_cache_path()
    return None if self._cache_path.lower() == "none" else self._cache_path

  def table_name(self) -> str:
    """The cache table of this device kind and these versions."""
    v = self.versions
    return (f"{self.device_kind} | jax {v.get('jax')} | jaxlib "
            f"{v.get('jaxlib')} | jaxcomp {v.get('jaxcomp')}")

  def _file(self) -> CacheFile | None:
    path = self.cache_path
    if path is None:
      return None
    if path not in self._files:
      self._files[path] = CacheFile(path)
    return self._files[path]

  def decisions(self) -> list[Decision]:
    """Every decision this process holds, in the order it was made."""
    with self._lock:
      return list(self._decisions.values())

  def clear(self) -> None:
    """Forgets the decisions held in memory (the cache file stays). In a job
    of several processes, call it on every process alike: each decision not
    held is agreed again, by one broadcast that every process joins."""
    with self._lock:
      self._decisions.clear()

  def resolve(self, tunable: Tunable) -> str:
    """The implementation of ``tunable`` under ``implementation=None``:
    one of ``tunable.candidates``, or ``"pallas"`` where
    ``JAXCOMP_KERNELS=pallas`` forces the op's Pallas path.

    Raises:
      ValueError: ``JAXCOMP_KERNELS`` is not one of :data:`MODES`, or is
        ``pallas`` off an NVIDIA GPU.
    """
    mode = os.environ.get(ENV_KERNELS, "autotune").strip().lower() or "autotune"
    if mode not in MODES:
      raise ValueError(
          f"{ENV_KERNELS}={os.environ.get(ENV_KERNELS)!r} must be one of "
          f"{MODES}: autotune (the default), xla (every op on XLA) or pallas "
          "(every op on the Pallas kernels)")
    if mode == "xla":
      return "xla"
    if not self.nvidia:
      if mode == "pallas":
        raise ValueError(
            f"{ENV_KERNELS}=pallas forces the Mosaic GPU kernels, which need "
            f"an NVIDIA GPU; the default backend is {jax.default_backend()}. "
            f"Unset {ENV_KERNELS} (or set it to xla) here.")
      return "xla"  # nothing is timed off NVIDIA GPUs
    key = tunable.key
    with self._lock:
      if mode == "pallas":
        reason = f"forced by {ENV_KERNELS}=pallas" + (
            "" if tunable.supported else "; the Pallas path does not take "
            "these parameters")
        decision = self._keep(Decision(
            key=key, implementation="pallas" if tunable.supported else "xla",
            source=f"not timed: {reason}", device=self.device_kind))
      else:
        decision = self._decisions.get(key)
        if decision is None or decision.source.startswith("not timed: forced"):
          decision = self._keep(self._agreed(key, tunable))
      for seen in self._seen:
        seen.append(decision)
      return decision.implementation

  def _keep(self, decision: Decision) -> Decision:
    """Holds ``decision`` in memory and logs it (once per key)."""
    old = self._decisions.get(decision.key)
    if old != decision:
      self._decisions[decision.key] = decision
      logger.info("%s", decision.describe())
    return decision

  def _agreed(self, key: TuneKey, tunable: Tunable) -> Decision:
    """This process's decision, or in a job of several processes process
    0's (broadcast to the others: :func:`_process_0s_choice`)."""
    if not self.agree or jax.process_count() == 1:
      return self._decide(key, tunable)
    if jax.process_index() == 0:
      decision = self._decide(key, tunable)
      _process_0s_choice(decision.implementation)
      return decision
    return Decision(key=key, implementation=_process_0s_choice("xla"),
                    source="process 0", device=self.device_kind)

  def _decide(self, key: TuneKey, tunable: Tunable) -> Decision:
    """From the cache file, or measured (and written to it)."""
    if not tunable.supported:
      return Decision(key=key, implementation="xla", device=self.device_kind,
                      source="not timed: the Pallas path does not take these "
                      "parameters")
    file, table = self._file(), self.table_name()
    if file is not None:
      entry = file.read(table).get(str(key))
      if entry is not None:
        try:
          return Decision.from_json(key, self.device_kind, entry)
        except (KeyError, TypeError, ValueError) as e:
          warnings.warn(f"jaxcomp.kernels: ignoring the cache entry for {key} "
                        f"in {file.path}: {e!r}", RuntimeWarning, stacklevel=5)
    decision = self._measure(key, tunable)
    if file is not None:
      try:
        file.write(table, str(key), decision.to_json())
      except OSError as e:
        warnings.warn(f"jaxcomp.kernels: cannot write the autotuning cache "
                      f"{file.path} ({e}); the choice is kept in memory",
                      RuntimeWarning, stacklevel=5)
    return decision

  def _measure(self, key: TuneKey, tunable: Tunable) -> Decision:
    """Times every candidate on a scratch input of ``tunable.n`` elements
    on the local device, outside the trace in progress; the fastest wins
    (of equal times XLA, else the first in ``tunable.candidates``)."""
    seconds: dict[str, float | None] = {}
    errors: dict[str, str] = {}

    def measure():
      device = jax.local_devices()[0]
      x = jax.device_put(
          jax.random.normal(jax.random.key(0), (tunable.n,), jnp.float32)
          .astype(tunable.dtype), device)
      extras = tunable.extras(x)
      for implementation in tunable.candidates:
        try:
          fn = tunable.run(implementation, self.interpret)
          seconds[implementation] = float(
              self.timer(key, implementation, fn, (x, *extras)))
        except Exception as e:  # pylint: disable=broad-except
          # A kernel that does not compile or run here (e.g. Mosaic GPU on a
          # GPU before Hopper) loses to the other candidates.
          seconds[implementation] = None
          errors[implementation] = (
              f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}")
          if implementation == "xla":
            raise

    _outside_traces(measure)
    # measure() raises where XLA fails: its time is a number.
    timed = {impl: s for impl, s in seconds.items() if s is not None}
    implementation = min(
        timed, key=lambda impl: (cast(float, timed[impl]), impl != "xla"))
    return Decision(
        key=key, implementation=implementation, source="measured",
        seconds=seconds, errors=errors, n=tunable.n, device=self.device_kind,
        when=datetime.datetime.now(datetime.UTC).isoformat(
            timespec="seconds"))


def _outside_traces(fn: Callable[[], None]) -> None:
  """Runs ``fn()`` on a thread of its own: JAX keeps its trace state per
  thread, so there the jitted calls of a measurement compile and run
  (inside the caller's ``jax.jit`` / ``shard_map`` trace they would be
  staged into it). Re-raises what ``fn`` raises."""
  failure: list[BaseException] = []

  def target():
    try:
      fn()
    except BaseException as e:  # pylint: disable=broad-except
      failure.append(e)

  thread = threading.Thread(target=target, name="jaxcomp-autotune")
  thread.start()
  thread.join()
  if failure:
    raise failure[0]


_DEFAULT: list[Autotuner] = []
_DEFAULT_LOCK = threading.Lock()
_CURRENT = threading.local()


def default_autotuner() -> Autotuner:
  """The process's :class:`Autotuner` (made at first use), or the one
  :func:`use_autotuner` put in place on this thread."""
  stack = getattr(_CURRENT, "stack", None)
  if stack:
    return stack[-1]
  with _DEFAULT_LOCK:
    if not _DEFAULT:
      _DEFAULT.append(Autotuner())
    return _DEFAULT[0]


@contextlib.contextmanager
def use_autotuner(tuner: Autotuner):
  """Makes ``tuner`` the one ``implementation=None`` asks, on this thread,
  inside the ``with`` block."""
  if not hasattr(_CURRENT, "stack"):
    _CURRENT.stack = []
  _CURRENT.stack.append(tuner)
  try:
    yield tuner
  finally:
    _CURRENT.stack.pop()


def resolve_implementation(implementation: str | None, *, op: str | None = None,
                           n: int | None = None, dtype=jnp.float32,
                           tunable: Tunable | None = None) -> str:
  """Returns the implementation to run: one of
  ``jaxcomp.kernels._autotune_cache.CHOICES``.

  Args:
    implementation: ``"pallas"``, ``"xla"`` or ``None``. Named, it is
      returned. ``None``: ``"xla"`` off NVIDIA GPUs (CPU, TPU, ROCm: Mosaic
      GPU kernels do not compile there) and with ``JAXCOMP_KERNELS=xla``;
      ``"pallas"`` with ``JAXCOMP_KERNELS=pallas``; on an NVIDIA GPU the
      candidate of ``tunable`` that :func:`default_autotuner` measures
      fastest (``"xla"``, ``"mosaic"`` or ``"triton"``; ``"xla"`` where no
      ``tunable`` describes the call).
    op, n, dtype: the op, its input's element count and dtype (used where
      no ``tunable`` is given).
    tunable: the call, for autotuning.

  Raises:
    ValueError: ``implementation`` is not one of the above; a bad
      ``JAXCOMP_KERNELS``.
  """
  if implementation is not None:
    if implementation not in IMPLEMENTATIONS:
      raise ValueError(
          f"implementation must be one of {IMPLEMENTATIONS} or None, got "
          f"{implementation=}")
    return implementation
  if tunable is None:
    if op is None or n is None:
      return default_autotuner().resolve(Tunable(
          op=op or "unknown", n=n or 0, dtype=dtype,
          run=_unavailable, supported=False))
    tunable = Tunable(op=op, n=n, dtype=dtype, run=_unavailable,
                      supported=False)
  return default_autotuner().resolve(tunable)


def _unavailable(implementation: str, interpret: bool):
  raise NotImplementedError("no candidates given")


def autotune(fn: Callable[..., Any], *args, tuner: Autotuner | None = None,
             **kwargs) -> list[Decision]:
  """Fills the autotuning cache for ``fn`` at the shapes of ``args``
  ahead of a job: traces ``fn(*args, **kwargs)`` (arrays or
  ``jax.ShapeDtypeStruct``s; nothing runs) under ``tuner`` (default
  :func:`default_autotuner`), so that every op inside with
  ``implementation=None`` is decided now (read from the cache file or
  measured, and written to it).

  Example: ``jaxcomp.kernels.autotune(train_step, params, opt_state,
  batch)`` before the training loop, or ``jaxcomp.kernels.autotune(
  compressor.encode, jax.ShapeDtypeStruct((n,), jnp.float32),
  jax.random.key(0))`` for one bucket size.

  Returns:
    The decisions the trace asked for, in order (repeats removed). A
    function JAX has already traced with these shapes is not traced again
    (its decisions are in :meth:`Autotuner.decisions` already).
  """
  tuner = tuner or default_autotuner()
  seen: list[Decision] = []
  with use_autotuner(tuner):
    with tuner._lock:
      tuner._seen.append(seen)
    try:
      jax.jit(lambda *a, **k: fn(*a, **k)).trace(*args, **kwargs)
    finally:
      with tuner._lock:
        tuner._seen.remove(seen)
  out, keys = [], set()
  for d in seen:
    if d.key not in keys:
      keys.add(d.key)
      out.append(d)
  return out
