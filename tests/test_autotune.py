"""Autotuning of ``implementation=None`` (jaxcomp/kernels/_autotune.py,
_autotune_cache.py).

An NVIDIA GPU is simulated on the CPU: an :class:`Autotuner` with
``nvidia=True`` and ``interpret=True`` (the Pallas candidates run in
interpret mode) and an injected timer that says which path is faster. Which
path a trace took is read from its CUDA export (a Mosaic GPU custom call or
none), the program a GPU would compile.
"""

import importlib.metadata
import json
import logging
import multiprocessing
import os
import re
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jaxcomp
from jaxcomp import kernels
from jaxcomp import launch
from jaxcomp.kernels import _autotune_cache
from jaxcomp.kernels import _triton
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block
from jaxcomp.kernels import qsgd as qsgd_kernel
from jaxcomp.kernels import sign
from jaxcomp.kernels import topk
from jaxcomp.hlo import kernel_structure as structure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
S = jax.ShapeDtypeStruct
SEED = jnp.array([3, 4], jnp.uint32)
VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "jaxcomp": "0.1.0"}
DEVICE = "NVIDIA H100 80GB HBM3 (simulated)"
# Candidates per key of the ops timed here: XLA, Mosaic GPU, and Triton
# where the dispatch takes it (not on a JAX whose Triton lowering warns).
TRITON = _triton.available()
CANDIDATES = 3 if TRITON else 2


class FakeTimer:
  """Says ``prefer[op]`` (default ``"xla"``) takes 1 ms and every other
  candidate 2 ms; with ``run=True`` it also runs each candidate once and keeps its
  outputs."""

  def __init__(self, prefer=None, run=False):
    self.prefer = prefer or {}
    self.run = run
    self.calls = []
    self.outputs = {}

  def __call__(self, key, implementation, fn, args):
    self.calls.append((str(key), implementation))
    if self.run:
      out = jax.block_until_ready(jax.jit(fn)(*args))
      self.outputs[(key.op, implementation)] = jax.tree.map(np.asarray, out)
    return 1e-3 if self.prefer.get(key.op, "xla") == implementation else 2e-3


def simulated(tmp_path, timer=None, **kw):
  kw.setdefault("cache_path", str(tmp_path / "autotune.json"))
  kw.setdefault("versions", VERSIONS)
  return kernels.Autotuner(timer=timer or FakeTimer(), nvidia=True,
                           interpret=True, device_kind=DEVICE, **kw)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch):
  monkeypatch.delenv(kernels.ENV_KERNELS, raising=False)
  monkeypatch.delenv(kernels.ENV_CACHE, raising=False)


def _fresh(fn):
  """``fn`` under a new identity: JAX's trace cache holds traces per
  function, and a cached trace keeps the path it was traced with."""
  return lambda *a: fn(*a)


def _uses_kernel(fn, *args) -> bool:
  """Whether ``jax.jit(fn)`` exported for CUDA calls a Pallas kernel
  (Mosaic GPU's, or one lowered by Triton)."""
  text = structure.export_cuda(_fresh(fn), *args).mlir_module()
  return any(f"stablehlo.custom_call @{t}" in text
             for t in structure.KERNEL_TARGETS)


def qsgd(x):
  return qsgd_kernel.qsgd_quantize_auto(x, levels=7, bucket_size=128, seed=SEED)


def int8(x):
  return int8_block.int8_block_quantize_auto(x, block_size=256)


# ---------------------------------------------------------------------------
# Off NVIDIA GPUs: nothing is timed.
# ---------------------------------------------------------------------------


@pytest.mark.skipif(kernels.nvidia_gpu(), reason="this backend is an NVIDIA GPU")
def test_off_nvidia_gpus_nothing_is_timed(tmp_path):
  timer = FakeTimer(prefer={"qsgd": "mosaic", "int8": "triton"})
  tuner = kernels.Autotuner(timer=timer, cache_path=str(tmp_path / "c.json"))
  assert not tuner.nvidia  # this machine's backend
  x = S((1 << 16,), jnp.float32)
  with kernels.use_autotuner(tuner):
    for name in ("qsgd", "int8_block", "sign", "topk", "fp8_block"):
      encode = jaxcomp.compressors.get(name).encode
      jax.jit(_fresh(encode)).trace(x, jax.random.key(0))
    assert not _uses_kernel(qsgd, x)
  assert timer.calls == [] and tuner.decisions() == []
  assert not os.path.exists(tmp_path / "c.json")


# ---------------------------------------------------------------------------
# The decision, the cache and its keys.
# ---------------------------------------------------------------------------


def test_simulated_gpu_takes_the_faster_path_per_key_and_caches_it(tmp_path):
  timer = FakeTimer(prefer={"qsgd": "mosaic", "int8": "xla"})
  tuner = simulated(tmp_path, timer)
  x = S((1 << 16,), jnp.float32)
  with kernels.use_autotuner(tuner):
    assert _uses_kernel(qsgd, x)  # QSGD: the kernel measured faster
    assert not _uses_kernel(int8, x)  # int8: XLA measured faster
    assert len(timer.calls) == 2 * CANDIDATES  # both keys' candidates, once
    assert _uses_kernel(qsgd, x) and not _uses_kernel(int8, x)
    assert _uses_kernel(qsgd, S((40_960,), jnp.float32))  # same key: n<=2^16, whole tiles
    assert len(timer.calls) == 2 * CANDIDATES  # held in memory: not timed again
  got = {d.key.op: d for d in tuner.decisions()}
  assert got["qsgd"].implementation == "mosaic"
  assert got["int8"].implementation == "xla"
  assert got["qsgd"].seconds == {"xla": 2e-3, "mosaic": 1e-3,
                                 **({"triton": 2e-3} if TRITON else {})}
  assert got["qsgd"].source == "measured" and got["qsgd"].n == 1 << 16
  # A new process (a new tuner) reads the file instead of timing.
  again = simulated(tmp_path, FakeTimer(prefer={"qsgd": "xla"}))
  with kernels.use_autotuner(again):
    assert _uses_kernel(qsgd, x)
  assert again.timer.calls == []
  assert again.decisions()[0].source == "cache file"
  data = json.loads((tmp_path / "autotune.json").read_text())
  table = data["tables"][f"{DEVICE} | jax 0.10.2 | jaxlib 0.10.2 | jaxcomp 0.1.0"]
  assert table[str(got["qsgd"].key)]["implementation"] == "mosaic"


def test_keys_separate_what_changes_the_kernel(tmp_path):
  """Size classes (powers of two), dtype, code width, bucket size,
  rounding and whether x is read in place each make their own key."""
  tuner = simulated(tmp_path, FakeTimer())
  cases = [
      (qsgd, (3000,), jnp.float32), (qsgd, (4000,), jnp.float32),  # 2^12
      (qsgd, (5000,), jnp.float32), (qsgd, (4096,), jnp.bfloat16),
      (lambda x: qsgd_kernel.qsgd_quantize_auto(x, levels=1, bucket_size=128,
                                             seed=SEED), (4096,), jnp.float32),
      (lambda x: qsgd_kernel.qsgd_quantize_auto(x, levels=7, bucket_size=256,
                                             seed=SEED), (4096,), jnp.float32),
      (lambda x: int8_block.int8_block_quantize_auto(x, block_size=256,
                                                   seed=SEED), (4096,), jnp.float32),
      (int8, (4096,), jnp.float32),
  ]
  with kernels.use_autotuner(tuner):
    for f, shape, dtype in cases:
      jax.jit(_fresh(f)).trace(S(shape, dtype))
  keys = [str(d.key) for d in tuner.decisions()]
  assert keys == [
      "qsgd float32 n<=2^12 bits=4 bucket_size=128 in_place=False rounding=seed",
      "qsgd float32 n<=2^13 bits=4 bucket_size=128 in_place=False rounding=seed",
      "qsgd bfloat16 n<=2^12 bits=4 bucket_size=128 in_place=True rounding=seed",
      "qsgd float32 n<=2^12 bits=2 bucket_size=128 in_place=True rounding=seed",
      "qsgd float32 n<=2^12 bits=4 bucket_size=256 in_place=True rounding=seed",
      "int8 float32 n<=2^12 block_size=256 in_place=True rounding=seed",
      "int8 float32 n<=2^12 block_size=256 in_place=True rounding=nearest",
  ], keys
  # 3000 and 4000 share n<=2^12 (and neither is whole tiles): one key.
  assert len(tuner.timer.calls) == CANDIDATES * len(keys)


def test_candidates_run_in_interpret_mode_and_agree(tmp_path):
  """The autotuner times the real candidates: each runs (the Pallas kernel
  in interpret mode here) and gives the other's payload."""
  timer = FakeTimer(run=True)
  tuner = simulated(tmp_path, timer)
  x = S((1 << 14,), jnp.float32)
  with kernels.use_autotuner(tuner):
    jax.jit(_fresh(int8)).trace(x)
    jax.jit(lambda v: sign.sign_pack_auto(v)).trace(x)
    jax.jit(lambda v: topk.topk_auto(v, 100)).trace(x)
    jax.jit(lambda v: fp8_block.fp8_block_quantize_auto(
        v, block_size=128, seed=SEED)).trace(x)
  for kernel in ("mosaic", "triton") if TRITON else ("mosaic",):
    for op in ("int8", "fp8"):
      for a, b in zip(timer.outputs[(op, kernel)], timer.outputs[(op, "xla")]):
        np.testing.assert_array_equal(a, b, err_msg=f"{op} {kernel}")
    np.testing.assert_array_equal(timer.outputs[("sign", kernel)][0],
                                  timer.outputs[("sign", "xla")][0])
    np.testing.assert_array_equal(np.sort(timer.outputs[("topk", kernel)][1]),
                                  np.sort(timer.outputs[("topk", "xla")][1]))


def test_measures_with_the_default_timer_inside_shard_map(tmp_path):
  """The default timer compiles and runs both candidates while a
  ``shard_map`` step is being traced (on a thread of its own, outside the
  trace)."""
  if jax.device_count() < 2:
    pytest.skip("needs 2 devices")
  tuner = simulated(tmp_path, timer=None)
  tuner.timer = lambda key, impl, fn, args: kernels.measure_seconds(
      fn, args, repeats=2, max_calls=2)
  mesh = jax.make_mesh((2,), ("d",))
  step = jax.shard_map(lambda v: qsgd(v)[1], mesh=mesh,
                       in_specs=jax.P("d"), out_specs=jax.P("d"))
  x = jax.device_put(jnp.ones((8192,)), jax.NamedSharding(mesh, jax.P("d")))
  with kernels.use_autotuner(tuner):
    jax.jit(step).trace(x)
  (d,) = tuner.decisions()
  assert d.n == 4096 and d.source == "measured"
  assert all(s is not None and s > 0 for s in d.seconds.values()), d


def test_a_failing_kernel_loses_and_the_error_is_kept(tmp_path):
  """A Pallas candidate that does not compile or run (e.g. Mosaic GPU on a
  GPU before Hopper) leaves XLA, with the error in the cache."""

  def timer(key, implementation, fn, args):
    if implementation == "mosaic":
      raise RuntimeError("Mosaic GPU needs sm_90a\nmore")
    return {"xla": 1e-3, "triton": 2e-3}[implementation]

  tuner = simulated(tmp_path, timer)
  with kernels.use_autotuner(tuner):
    assert not _uses_kernel(qsgd, S((4096,), jnp.float32))
  (d,) = tuner.decisions()
  assert d.implementation == "xla" and d.seconds["mosaic"] is None
  assert d.errors == {"mosaic": "RuntimeError: Mosaic GPU needs sm_90a"}
  entry = json.loads((tmp_path / "autotune.json").read_text())
  assert "sm_90a" in json.dumps(entry)


def _targets(fn, *args) -> list[str]:
  """The kernel calls in ``jax.jit(fn)``'s CUDA export."""
  text = structure.export_cuda(_fresh(fn), *args).mlir_module()
  return [t for t in structure.KERNEL_TARGETS
          if f"stablehlo.custom_call @{t}" in text]


@pytest.mark.skipif(not TRITON, reason="the dispatch takes no Triton kernel "
                    "on this JAX (kernels._triton.available)")
@pytest.mark.parametrize("fastest, target", [
    ("xla", None), ("mosaic", "mosaic_gpu"), ("triton", structure.TRITON_TARGET)])
def test_the_fastest_of_three_candidates_reaches_the_program(
    tmp_path, fastest, target):
  """Per op, dtype and size the autotuner times XLA, the Mosaic GPU and the
  Triton kernel (injected timings) and the program calls the fastest."""
  timer = FakeTimer(prefer={"int8": fastest, "sign": fastest})
  tuner = simulated(tmp_path, timer)
  x = S((4096,), jnp.float32)
  with kernels.use_autotuner(tuner):
    for f in (int8, sign.sign_pack_auto):
      assert _targets(f, x) == ([target] if target else []), f
  assert sorted(timer.calls) == sorted(
      (str(d.key), c) for d in tuner.decisions() for c in kernels.CANDIDATES)
  assert {d.implementation for d in tuner.decisions()} == {fastest}


def test_without_triton_the_triton_kernels_are_no_candidates(
    tmp_path, monkeypatch):
  """Where the dispatch takes no Triton kernel (Pallas' Triton backend
  absent, or warning at each lowering), the autotuner times XLA and Mosaic
  GPU only (equal times go to XLA), and the int8 blocks' ``pallas`` path is
  XLA for power-of-two blocks, the Mosaic GPU kernel for the others."""
  monkeypatch.setattr(_triton, "available", lambda: False)
  timer = FakeTimer(prefer={"int8": "triton"})
  tuner = simulated(tmp_path, timer)
  x = S((4096,), jnp.float32)
  with kernels.use_autotuner(tuner):
    assert _targets(int8, x) == []
  assert [c[1] for c in timer.calls] == ["xla", "mosaic"]
  assert tuner.decisions()[0].implementation == "xla"
  pallas = lambda b: lambda v: int8_block.int8_block_quantize_auto(
      v, block_size=b, implementation="pallas")
  assert _targets(pallas(256), x) == []
  assert _targets(pallas(96), S((4800,), jnp.float32)) == ["mosaic_gpu"]


def test_unsupported_parameters_are_not_timed(tmp_path):
  """A block size that is not a multiple of 32 has no Pallas path: XLA,
  untimed (the kernel would raise)."""
  tuner = simulated(tmp_path, FakeTimer(prefer={"int8": "triton"}))
  with kernels.use_autotuner(tuner):
    assert not _uses_kernel(
        lambda x: int8_block.int8_block_quantize_auto(x, block_size=48),
        S((4800,), jnp.float32))
  assert tuner.timer.calls == []
  assert tuner.decisions()[0].source.startswith("not timed")


def test_version_change_measures_again(tmp_path):
  old = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}),
                  versions=dict(VERSIONS, jaxcomp="0.0.9"))
  x = S((4096,), jnp.float32)
  with kernels.use_autotuner(old):
    assert _uses_kernel(qsgd, x)
  new = simulated(tmp_path, FakeTimer(prefer={"qsgd": "xla"}))
  with kernels.use_autotuner(new):
    assert not _uses_kernel(qsgd, x)  # not the old version's choice
  assert len(new.timer.calls) == CANDIDATES
  tables = json.loads((tmp_path / "autotune.json").read_text())["tables"]
  assert sorted(t.rsplit(" ", 1)[1] for t in tables) == ["0.0.9", "0.1.0"]
  jaxlib = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}),
                     versions=dict(VERSIONS, jaxlib="0.11.0"))
  with kernels.use_autotuner(jaxlib):
    assert _uses_kernel(qsgd, x)
  assert len(jaxlib.timer.calls) == CANDIDATES


def test_versions_come_from_the_installed_distributions():
  v = _autotune_cache.environment_versions()
  assert v["jax"] == jax.__version__
  assert v["jaxlib"] == importlib.metadata.version("jaxlib")
  try:
    installed = importlib.metadata.version("jaxcomp")
  except importlib.metadata.PackageNotFoundError:
    # A source checkout on PYTHONPATH (the device check on a GPU machine) has
    # no distribution: the cache table is keyed "unknown" there.
    assert v["jaxcomp"] == "unknown"
    return
  assert v["jaxcomp"] == installed == jaxcomp.__version__


@pytest.mark.parametrize("content", ["{not json", '{"format": 1, "tables": []}',
                                     '{"format": 99, "tables": {}}', ""])
def test_corrupt_cache_file_is_ignored_with_a_warning(tmp_path, content):
  path = tmp_path / "autotune.json"
  path.write_text(content)
  tuner = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}))
  with kernels.use_autotuner(tuner):
    with pytest.warns(RuntimeWarning, match="cannot be read"):
      assert _uses_kernel(qsgd, S((4096,), jnp.float32))
  assert len(tuner.timer.calls) == CANDIDATES
  data = json.loads(path.read_text())  # rewritten as a valid cache
  assert data["format"] == 1 and len(next(iter(data["tables"].values()))) == 1


def test_bad_entry_is_ignored_with_a_warning(tmp_path):
  tuner = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}))
  key = "qsgd float32 n<=2^12 bits=4 bucket_size=128 in_place=True rounding=seed"
  (tmp_path / "autotune.json").write_text(json.dumps(
      {"format": 1, "tables": {tuner.table_name(): {key: {"implementation": "cuda"}}}}))
  with kernels.use_autotuner(tuner):
    with pytest.warns(RuntimeWarning, match="ignoring the cache entry"):
      assert _uses_kernel(qsgd, S((4096,), jnp.float32))
  assert len(tuner.timer.calls) == CANDIDATES


def _write_keys(path, worker, count):
  cache = _autotune_cache.CacheFile(path)
  for i in range(count):
    cache.write("table", f"w{worker} k{i}", {"implementation": "xla", "i": i})


def test_concurrent_writers_lose_nothing(tmp_path):
  """Processes writing the same file at once (the lock and the atomic
  replace): every entry of every writer is there, and the file is whole."""
  path = str(tmp_path / "autotune.json")
  ctx = multiprocessing.get_context("spawn")
  procs = [ctx.Process(target=_write_keys, args=(path, w, 30)) for w in range(3)]
  for p in procs:
    p.start()
  _write_keys(path, 3, 30)  # and this process
  for p in procs:
    p.join(120)
    assert p.exitcode == 0
  table = json.loads(open(path).read())["tables"]["table"]
  assert sorted(table) == sorted(f"w{w} k{i}" for w in range(4) for i in range(30))


@pytest.mark.skipif(not kernels.nvidia_gpu(),
                    reason="measures the compiled kernels on an NVIDIA GPU")
def test_measures_both_paths_on_this_gpu(tmp_path):
  """On a real NVIDIA GPU: both paths compile and run, the faster is
  taken, and the choice reaches the program."""
  tuner = kernels.Autotuner(cache_path=str(tmp_path / "autotune.json"))
  assert tuner.nvidia
  n = 1 << 22
  with kernels.use_autotuner(tuner):
    for f in (qsgd, int8, lambda v: topk.topk_auto(v, n // 100),
              lambda v: sign.sign_pack_auto(v)):
      jax.jit(_fresh(f)).trace(S((n,), jnp.float32))
  for d in tuner.decisions():
    assert d.source == "measured" and d.errors == {}, d.describe()
    assert all(0 < t < 1 for t in d.seconds.values()), d.describe()
    faster = min(d.seconds, key=d.seconds.get)
    assert d.implementation == faster, d.describe()
  with kernels.use_autotuner(tuner):
    d = next(d for d in tuner.decisions() if d.key.op == "qsgd")
    assert _uses_kernel(qsgd, S((n,), jnp.float32)) == (d.implementation != "xla")


# ---------------------------------------------------------------------------
# Overrides, logging, autotune().
# ---------------------------------------------------------------------------


def test_environment_overrides(tmp_path, monkeypatch):
  x = S((4096,), jnp.float32)
  tuner = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}))
  with kernels.use_autotuner(tuner):
    monkeypatch.setenv(kernels.ENV_KERNELS, "xla")  # autotuning off
    assert not _uses_kernel(qsgd, x)
    monkeypatch.setenv(kernels.ENV_KERNELS, "pallas")  # forced, untimed
    # (QSGD's pallas path is its Mosaic GPU kernel on every JAX; int8 blocks
    # of 256 take XLA where the dispatch takes no Triton kernel.)
    assert _uses_kernel(qsgd, x)
    assert _uses_kernel(int8, x) == TRITON
    assert tuner.timer.calls == []
    monkeypatch.setenv(kernels.ENV_KERNELS, "triton")
    with pytest.raises(ValueError, match="JAXCOMP_KERNELS='triton' must be one of"):
      jax.jit(_fresh(qsgd)).trace(x)
    monkeypatch.setenv(kernels.ENV_KERNELS, "autotune")
    assert _uses_kernel(int8, x) is False  # measured now: XLA faster
    # A caller's explicit choice wins over all of it.
    assert not _uses_kernel(lambda v: qsgd_kernel.qsgd_quantize_auto(
        v, levels=7, bucket_size=128, seed=SEED, implementation="xla"), x)
  assert [c[0].split()[0] for c in tuner.timer.calls] == ["int8"] * CANDIDATES
  # Forcing the kernels off an NVIDIA GPU is an error, not a silent no-op.
  monkeypatch.setenv(kernels.ENV_KERNELS, "pallas")
  with kernels.use_autotuner(kernels.Autotuner(cache_path="none", nvidia=False)):
    with pytest.raises(ValueError, match="which need an NVIDIA GPU"):
      jax.jit(_fresh(qsgd)).trace(x)


def test_cache_path_from_the_environment(tmp_path, monkeypatch):
  path = tmp_path / "elsewhere" / "tuning.json"
  monkeypatch.setenv(kernels.ENV_CACHE, str(path))
  tuner = kernels.Autotuner(timer=FakeTimer(), nvidia=True, interpret=True,
                            device_kind=DEVICE, versions=VERSIONS)
  assert tuner.cache_path == str(path)
  with kernels.use_autotuner(tuner):
    jax.jit(_fresh(qsgd)).trace(S((4096,), jnp.float32))
  assert path.exists()
  monkeypatch.setenv(kernels.ENV_CACHE, "none")
  assert tuner.cache_path is None
  monkeypatch.delenv(kernels.ENV_CACHE)
  monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
  assert tuner.cache_path == str(tmp_path / "xdg" / "jaxcomp" / "autotune.json")


def test_each_choice_is_logged_once(tmp_path, caplog):
  tuner = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}))
  caplog.set_level(logging.INFO, logger="jaxcomp.kernels")
  with kernels.use_autotuner(tuner):
    for _ in range(3):
      jax.jit(_fresh(qsgd)).trace(S((4096,), jnp.float32))
      jax.jit(_fresh(int8)).trace(S((4096,), jnp.float32))
  lines = [r.getMessage() for r in caplog.records if r.name == "jaxcomp.kernels"]
  assert len(lines) == 2, lines
  assert re.match(r"qsgd float32 n<=2\^12 .* on NVIDIA H100 80GB HBM3 \(simulated\): "
                  r"mosaic \(measured: mosaic 1.0000 ms, "
                  + (r"triton 2.0000 ms, " if TRITON else "")
                  + r"xla 2.0000 ms at n=4,096\)",
                  lines[0]), lines[0]


def test_autotune_fills_the_cache_ahead_of_a_job(tmp_path):
  """``jaxcomp.kernels.autotune`` traces a step at given shapes (nothing
  runs) and returns the decisions it asked for; the job's own trace then
  reads them."""
  tuner = simulated(tmp_path, FakeTimer(prefer={"qsgd": "mosaic"}))
  c = jaxcomp.compressors.get("qsgd")
  made = kernels.autotune(c.encode, S((1 << 16,), jnp.float32),
                          jax.random.key(0), tuner=tuner)
  assert [(d.key.op, d.implementation, d.source) for d in made] == [
      ("qsgd", "mosaic", "measured")]
  job = simulated(tmp_path, FakeTimer(prefer={"qsgd": "xla"}))
  with kernels.use_autotuner(job):
    assert _uses_kernel(lambda x: c.encode(x, jax.random.key(0)),
                        S((1 << 16,), jnp.float32))
  assert job.timer.calls == []


# ---------------------------------------------------------------------------
# Processes of one job agree.
# ---------------------------------------------------------------------------


def test_two_processes_compile_the_same_program(tmp_path):
  """2 processes over gloo, each simulating a GPU whose timer prefers the
  path the other's does not, process 1's cache file holding the opposite
  of process 0's choices: with the agreement every process exports the same
  CUDA programs (``check_agreement`` passes) and process 1 neither times nor
  reads its file; each process alone, the check fails."""
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMP_")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  out = []

  class Sink:
    def write(self, s):
      out.append(s)

    def flush(self):
      pass

  res = launch.launch([sys.executable, os.path.join(ROOT, "tests", "autotune_job.py"),
                       str(tmp_path)], 2, devices_per_process=1, env=env,
                      stdout=Sink(), timeout=400)
  log = "".join(out)
  assert res.returncode == 0, log
  results = [json.loads(line.split("RESULT ", 1)[1])
             for line in log.splitlines() if "RESULT " in line]
  agree = {r["process"]: r for r in results if r["mode"] == "agree"}
  alone = {r["process"]: r for r in results if r["mode"] == "alone"}
  assert agree[0]["digest"] == agree[1]["digest"], log
  assert agree[0]["choices"] == agree[1]["choices"], log
  assert agree[0]["sources"] == ["measured"] and agree[1]["sources"] == ["process 0"]
  assert agree[0]["timer_calls"] == 8 * CANDIDATES and agree[1]["timer_calls"] == 0
  # Process 0's choices: its timer's (QSGD on Mosaic, sign on Triton where
  # Triton is a candidate).
  assert {k.split()[0]: v for k, v in agree[0]["choices"].items()} == {
      "qsgd": "mosaic", "sign": "triton" if TRITON else "xla", "int8": "xla",
      "topk": "xla"}
  for p in (0, 1):
    assert "disagree on their programs" in (alone[p]["disagreement"] or ""), log
