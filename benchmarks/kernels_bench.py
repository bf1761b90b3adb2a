"""Benchmark of the compression kernels, run from a source checkout:
``python benchmarks/kernels_bench.py [--ops ...] [--sizes ...]``.

For each dtype, size and op it prints the median time per call, the effective
bandwidth (bytes the op must read and write at least, divided by the time) and
three ratios, all measured in the same process on the same data:

* ``x/copy``: time over the time of one device-to-device memory pass
  ``x * 2`` (read + write of ``x``): 1.0 is a kernel as fast as a copy;
* ``vs top_k``: speed-up over ``lax.top_k(|x|, k)`` (top-k ops only);
* ``vs ref``: speed-up over the op's XLA reference (the ``*_reference``
  function of ``jaxcomp.kernels``).

Top-k rows: ``xla`` is the sampled-threshold fast path, ``auto`` what the
compressors call by default (``topk_auto``), ``pallas`` the Pallas path (one
mask kernel, the radix select in its fallback), ``pallas:triton`` the same
selection compacted by two Triton-lowered kernels (``topk_triton``;
``pallas:triton,band`` sorting only the band between the sample's
thresholds; ``--triton-spans`` times other elements-per-program). With ``--topk-selection``
the ``xla`` and ``pallas`` top-k rows are also timed under each named form
of the sampled selection (``xla:sort``, ``pallas:partial``, ...:
``TopKConfig.selection``).

With ``--torch`` (and PyTorch importable) it also times ``torch.topk`` of
``|x|`` and ``x * 2`` in PyTorch on the same buffers (shared through DLPack),
and prints ``vs torch``: the speed-up over ``torch.topk``.

Timing. The input is held in several copies, together over ``--cache-bytes``
(default 2e8 bytes, 4x a Hopper L2, and at least 4 copies on GPU; one copy
elsewhere), so that no call finds its input in cache. On GPU one jitted
program applies the op to every copy (the calls run back to back on the
device, with no host dispatch between them) and a trial runs that program
``--calls`` times; elsewhere a trial is ``--calls`` plain calls. The time per
call is the trial's time over the calls, and the figure is the median over
``--repeats`` trials, after warm-up (compile) calls. PyTorch's ops are
dispatched one by one, cycling through the same copies.
On a GPU the Pallas kernels are timed next to the XLA paths; elsewhere only
the XLA paths are (interpret mode is a correctness tool, not a path).

Every array a timed function reads is an argument of the program that is
timed (the input copies, and the shared operands of an op: QSGD's uniform
numbers, DGC's key), built before it and outside it; the function itself
closes over no array, so the program holds no input-sized constant for XLA
to fold while compiling (a closed-over uniform array, padded in the program,
once took most of 200 s of compilation at 1e8 elements on a GPU).

``--json PATH`` writes every row (with the device, date, JAX version and
the arguments) so that later changes can be compared against a saved run
(``python benchmarks/device_check.py`` compares its top-k rows with the
latest earlier table of the same device kind).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import statistics
import sys
import time
import traceback
from typing import Any
from collections.abc import Callable

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)  # the checkout's jaxcomp

import jax
import jax.numpy as jnp

from jaxcomp import kernels
from jaxcomp.kernels import fp8_block
from jaxcomp.kernels import int8_block
from jaxcomp.kernels import qsgd
from jaxcomp.kernels import sign
from jaxcomp.kernels import topk

DTYPES = {"f32": jnp.float32, "bf16": jnp.bfloat16, "f16": jnp.float16}
OPS = ("topk", "sampled_topk", "sign", "qsgd", "int8", "fp8")
TOPK_OPS = ("topk", "sampled_topk")
# The block quantizers: (XLA reference, Mosaic GPU kernel, Triton kernel).
BLOCK_OPS = {
    "int8": (int8_block.int8_block_quantize_reference,
             int8_block.int8_block_quantize,
             int8_block.int8_block_quantize_triton),
    "fp8": (fp8_block.fp8_block_quantize_reference,
            fp8_block.fp8_block_quantize,
            fp8_block.fp8_block_quantize_triton),
}


def _size(text: str) -> int:
  return int(float(text))


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--sizes", type=_size, nargs="+", default=[25_000_000],
                      help="element counts, e.g. 1e6 2.5e7 (default 2.5e7)")
  parser.add_argument("--dtype", choices=sorted(DTYPES), nargs="+",
                      default=["f32"])
  parser.add_argument("--density", type=float, default=0.01,
                      help="top-k density k/n (default 0.01)")
  parser.add_argument("--repeats", type=int, default=7,
                      help="timed trials; the median is reported")
  parser.add_argument("--calls", type=int, default=None,
                      help="calls (GPU: of the unrolled program) per trial "
                      "(default 3 on GPU, 1 elsewhere)")
  parser.add_argument("--cache-bytes", type=_size, default=None,
                      help="input copies cycled per trial exceed this many "
                      "bytes (default 2e8 on GPU, 0 elsewhere)")
  parser.add_argument("--ops", nargs="+", choices=OPS, default=list(OPS))
  parser.add_argument("--levels", type=int, default=15, help="QSGD levels")
  parser.add_argument("--bucket-size", type=int, default=512,
                      help="QSGD bucket / int8 and fp8 block size")
  parser.add_argument("--implementation", choices=("auto", "xla", "pallas",
                                                    "both"), default="auto",
                      help="auto: pallas too when the backend is a GPU")
  parser.add_argument("--block-rows", type=int, nargs="+", default=None,
                      help="Pallas block_rows variants to time (default: "
                      "each config's default)")
  parser.add_argument("--radix-bits", type=int, nargs="+", default=None,
                      help="Pallas top-k radix_bits variants to time")
  parser.add_argument("--topk-selection", nargs="+", choices=topk.SELECTIONS,
                      default=None, help="also time the top-k paths under "
                      "each of these forms of the sampled selection (rows "
                      "xla:<form>, pallas:<form>)")
  parser.add_argument("--triton-spans", type=int, nargs="+", default=None,
                      help="Triton top-k span variants to time (elements "
                      "per program; rows pallas:triton,span<N>)")
  parser.add_argument("--torch", action="store_true",
                      help="also time torch.topk and a PyTorch memory pass")
  parser.add_argument("--json", default=None, help="write the rows here")


def _on_gpu() -> bool:
  return jax.default_backend() in ("gpu", "cuda")


def timed_program(fn: Callable) -> Callable:
  """The jitted program that applies ``fn`` to every input copy:
  ``program(extra, *xs)`` returns ``tuple(fn(x, *extra) for x in xs)``.
  The copies and ``extra`` are its arguments, so nothing input-sized is a
  constant of the program."""
  return jax.jit(lambda extra, *xs: tuple(fn(x, *extra) for x in xs))


def time_calls(fn: Callable, inputs: list, *, repeats: int, calls: int,
               extra: tuple = (), sync: Callable = jax.block_until_ready,
               unrolled: bool = False) -> float:
  """Median seconds per call of ``fn(x, *extra)`` over the ``x`` in
  ``inputs`` (see module doc).

  ``unrolled``: one jitted program (:func:`timed_program`) applies ``fn`` to
  every input (the calls run back to back on the device, with no host
  dispatch between them), and each trial runs that program ``calls`` times.
  """
  if unrolled:
    multi = timed_program(fn)
    run, per_trial = (lambda: multi(extra, *inputs)), calls * len(inputs)
  else:
    run, per_trial = None, calls
  for x in inputs:  # compile and warm up
    sync(fn(x, *extra))
  if run is not None:
    sync(run())
  per_call = []
  for _ in range(repeats):
    start = time.perf_counter()
    if run is not None:
      outs = [run() for _ in range(calls)]
    else:
      outs = [fn(inputs[i % len(inputs)], *extra) for i in range(calls)]
    sync(outs)
    per_call.append((time.perf_counter() - start) / per_trial)
  return statistics.median(per_call)


def _label(impl: str = "pallas", **knobs) -> str:
  """``pallas`` or ``pallas:br256,rb4`` for the knobs that were set (a
  string knob by its value: ``xla:sort``)."""
  parts = [v if isinstance(v, str) else f"{k}{v}"
           for k, v in knobs.items() if v is not None]
  return impl + (":" + ",".join(parts) if parts else "")


def _replace(config, **knobs):
  return dataclasses.replace(
      config, **{k: v for k, v in knobs.items() if v is not None})


def _topk_variants(args) -> list[tuple[str, topk.TopKConfig]]:
  """``(label, config)`` for every block_rows x radix_bits x selection
  combination."""
  return [(_label(br=br, rb=rb, sel=sel),
           _replace(topk.DEFAULT_CONFIG, block_rows=br, radix_bits=rb,
                    selection=sel))
          for br in args.block_rows or [None]
          for rb in args.radix_bits or [None]
          for sel in [None, *(args.topk_selection or [])]]


def _quantize_variants(args) -> list[tuple[str, kernels.QuantizeConfig]]:
  """``(label, config)`` for every block_rows (the only quantize knob)."""
  return [(_label(br=br), _replace(kernels.QuantizeConfig(), block_rows=br))
          for br in args.block_rows or [None]]


@dataclasses.dataclass
class OpCases:
  """What the benchmark times for one op at one size.

  Attributes:
    nbytes: bytes the op must read and write at least.
    reference: the op's XLA reference.
    cases: label (``xla``, ``auto``, ``pallas[:knobs]``) -> function.
    extra: the arrays every function takes after ``x``: each is called as
      ``fn(x, *extra)``.
  """
  nbytes: int
  reference: Callable
  cases: dict[str, Callable]
  extra: tuple = ()


def op_cases(op: str, *, n: int, k: int, itemsize: int,
             args: argparse.Namespace) -> OpCases:
  """The functions timed for ``op`` at ``n`` elements (``k`` kept by the
  top-k ops), each jitted, each taking every array it reads as an argument
  (:attr:`OpCases.extra`, built here, outside them).

  Raises:
    ValueError: an unknown ``op``.
  """
  topk_bytes = n * itemsize + 8 * k
  cases: dict[str, Callable] = {}
  if op == "topk":
    ref = jax.jit(lambda x: topk.topk_reference(x, k))
    cases["xla"] = jax.jit(lambda x: topk.topk_threshold_xla(x, k))
    cases["auto"] = jax.jit(lambda x: topk.topk_auto(x, k))
    for form in args.topk_selection or []:
      cfg = _replace(topk.DEFAULT_CONFIG, selection=form)
      cases[_label("xla", sel=form)] = jax.jit(
          lambda x, c=cfg: topk.topk_threshold_xla(x, k, config=c))
    for label, tcfg in _topk_variants(args):
      cases[label] = jax.jit(lambda x, c=tcfg: topk.topk(x, k, config=c))
    for span in args.triton_spans or [None]:
      for band in (False, True):
        cases[_label("pallas", t="triton", span=span,
                     sort="band" if band else None)] = jax.jit(
            lambda x, sp=span or topk.TRITON_SPAN, b=band: topk.topk_triton(
                x, k, span=sp, band_only=b))
    return OpCases(topk_bytes, ref, cases)
  if op == "sampled_topk":
    ref = jax.jit(lambda x, key: topk.topk_reference(x, k))
    cases["xla"] = jax.jit(lambda x, key: topk.sampled_topk(
        x, k, key, sample_ratio=0.01, implementation="xla"))
    for label, tcfg in _topk_variants(args):
      cases[label] = jax.jit(lambda x, key, c=tcfg: topk.sampled_topk(
          x, k, key, sample_ratio=0.01, implementation="pallas", config=c))
    cases["pallas:triton"] = jax.jit(lambda x, key: topk.sampled_topk_triton(
        x, k, key, sample_ratio=0.01))
    return OpCases(topk_bytes, ref, cases, (jax.random.key(2),))
  if op == "sign":
    for label, qcfg in _quantize_variants(args):
      cases[label] = jax.jit(lambda x, c=qcfg: sign.sign_pack(x, config=c))
    cases["pallas:triton"] = jax.jit(sign.sign_pack_triton)
    return OpCases(n * itemsize + n // 8, jax.jit(sign.sign_pack_reference),
                   cases)
  if op == "qsgd":
    bits = qsgd.qsgd_bits(args.levels)
    ref = jax.jit(lambda x, u: qsgd.qsgd_quantize_reference(
        x, u, levels=args.levels, bucket_size=args.bucket_size))
    for label, qcfg in _quantize_variants(args):
      cases[label] = jax.jit(lambda x, u, c=qcfg: qsgd.qsgd_quantize(
          x, u, levels=args.levels, bucket_size=args.bucket_size, config=c))
    if kernels.triton_supported_block(args.bucket_size):
      cases["pallas:triton"] = jax.jit(lambda x, u: qsgd.qsgd_quantize_triton(
          x, u, levels=args.levels, bucket_size=args.bucket_size))
    u = jax.random.uniform(jax.random.key(99), (n,), jnp.float32)
    return OpCases(n * itemsize + 4 * n + n * bits // 8, ref, cases, (u,))
  if op in BLOCK_OPS:
    reference, mosaic, triton = BLOCK_OPS[op]
    size = args.bucket_size
    ref = jax.jit(lambda x: reference(x, block_size=size))
    for label, qcfg in _quantize_variants(args):
      cases[label] = jax.jit(lambda x, c=qcfg: mosaic(x, block_size=size,
                                                      config=c))
    if kernels.triton_supported_block(size):
      cases["pallas:triton"] = jax.jit(lambda x: triton(x, block_size=size))
    return OpCases(n * itemsize + n, ref, cases)
  raise ValueError(f"unknown op {op!r}; one of {OPS}")


HEADER = (f"{'dtype':<5} {'op':<13} {'impl':<18} {'n':>11} {'ms':>9} "
          f"{'GB/s':>8} {'x/copy':>7} {'vs top_k':>9} {'vs ref':>7} "
          f"{'vs torch':>8}")


def _fmt(v):
  return "-" if v is None else f"{v:.2f}"


def _import_torch(args: argparse.Namespace):
  """PyTorch where ``--torch`` asks for it and it is importable, else None."""
  if not args.torch:
    return None
  try:
    # Optional (--torch): not a dependency.
    import torch  # pylint: disable=import-outside-toplevel  # pyright: ignore[reportMissingImports]
  except ImportError:
    print("--torch: PyTorch is not importable; skipping its baselines")
    return None
  return torch


@dataclasses.dataclass
class _Run:
  """One run of the benchmark: its settings and the rows measured so far.

  Attributes:
    args: the command line.
    gpu: whether the backend is a GPU (the calls are then unrolled).
    calls: calls per trial (``--calls``, or its default).
    meta: what the run is (device, date, JAX version, arguments), printed
      first and written with the rows.
    rows: one dict per row printed.
  """
  args: argparse.Namespace
  gpu: bool
  calls: int
  meta: dict[str, Any]
  rows: list[dict[str, Any]] = dataclasses.field(default_factory=list)

  def measure(self, fn, inputs, sync=None, extra=()):
    """``(seconds per call, None)``, or ``(None, error)`` where ``fn``
    fails (its traceback printed)."""
    try:
      if sync is None:  # a JAX function
        return time_calls(fn, inputs, repeats=self.args.repeats,
                          calls=self.calls, extra=extra,
                          unrolled=self.gpu), None
      return time_calls(fn, inputs, repeats=self.args.repeats,
                        calls=self.calls * len(inputs), sync=sync), None
    except Exception as e:  # pylint: disable=broad-except
      traceback.print_exc()
      first = (str(e).splitlines() or [""])[0][:200]
      return None, f"{type(e).__name__}: {first}"

  def emit(self, dtype, op, impl, n, seconds, nbytes, base, error=None):
    """Records, writes (``--json``) and prints one row; ``base`` holds the
    baselines' seconds that the ratios divide by."""
    row = {"dtype": dtype, "op": op, "impl": impl, "n": n,
           "seconds": seconds, "bytes": nbytes, "error": error}
    if seconds is not None:
      row["gb_per_s"] = nbytes / seconds / 1e9
      for key in ("copy", "top_k", "ref", "torch"):
        b = base.get(key)
        row[f"ratio_{key}"] = None if b is None else (
            seconds / b if key == "copy" else b / seconds)
    self.rows.append(row)
    if self.args.json:  # after every row, so a run cut short keeps what it has
      with open(self.args.json, "w", encoding="utf-8") as f:
        json.dump({"meta": self.meta, "rows": self.rows}, f, indent=1)
    if error is not None:
      print(f"{dtype:<5} {op:<13} {impl:<18} {n:>11,d} FAILED: {error}")
      return
    assert seconds is not None  # measure() times or fails
    print(f"{dtype:<5} {op:<13} {impl:<18} {n:>11,d} {seconds * 1e3:>9.3f} "
          f"{row['gb_per_s']:>8.1f} {_fmt(row['ratio_copy']):>7} "
          f"{_fmt(row['ratio_top_k']):>9} {_fmt(row['ratio_ref']):>7} "
          f"{_fmt(row['ratio_torch']):>8}")


def _time_baselines(run: _Run, torch, dname: str, n: int, k: int, xs: list
                    ) -> dict[str, float | None]:
  """Times and prints the baselines at one dtype and size: the copy
  ``x * 2``, ``lax.top_k`` (with top-k ops), and PyTorch's copy and
  ``torch.topk`` (``--torch`` on a GPU). Returns their seconds by key
  (``copy``, ``top_k``, ``torch``)."""
  itemsize = jnp.dtype(DTYPES[dname]).itemsize
  base: dict[str, float | None] = {}
  t, err = run.measure(jax.jit(lambda x: x * 2), xs)
  base["copy"] = t
  run.emit(dname, "copy x*2", "xla", n, t, 2 * n * itemsize, base, err)
  topk_bytes = n * itemsize + 8 * k
  with_topk = bool(set(TOPK_OPS) & set(run.args.ops))
  if with_topk:
    t, err = run.measure(jax.jit(lambda x: jax.lax.top_k(jnp.abs(x), k)), xs)
    base["top_k"] = t
    run.emit(dname, "lax.top_k", "xla", n, t, topk_bytes, base, err)
  if torch is not None and run.gpu:
    txs = [torch.from_dlpack(x) for x in xs]
    sync = lambda _: torch.cuda.synchronize()
    t, err = run.measure(lambda x: x * 2, txs, sync)
    run.emit(dname, "copy x*2", "torch", n, t, 2 * n * itemsize, base, err)
    if with_topk:
      t, err = run.measure(lambda x: torch.topk(x.abs(), k), txs, sync)
      base["torch"] = t
      run.emit(dname, "torch.topk", "torch", n, t, topk_bytes, base, err)
    del txs
  return base


def _time_op(run: _Run, op: str, impls: list[str], dname: str, n: int,
             k: int, xs: list, base: dict[str, float | None]) -> None:
  """Times and prints ``op``'s reference and each of its cases whose
  implementation is in ``impls`` (or ``auto``), against ``base``."""
  tbase = dict(base) if op in TOPK_OPS else {"copy": base["copy"]}
  itemsize = jnp.dtype(DTYPES[dname]).itemsize
  c = op_cases(op, n=n, k=k, itemsize=itemsize, args=run.args)
  t, err = run.measure(c.reference, xs, extra=c.extra)
  tbase["ref"] = t
  run.emit(dname, op, "reference", n, t, c.nbytes, tbase, err)
  for label, fn in c.cases.items():
    if label.split(":")[0] not in impls + ["auto"]:
      continue
    t, err = run.measure(fn, xs, extra=c.extra)
    run.emit(dname, op, label, n, t, c.nbytes, tbase, err)


def main(args: argparse.Namespace) -> int:
  gpu = _on_gpu()
  impls = {"auto": ["xla"] + (["pallas"] if gpu else []), "xla": ["xla"],
           "pallas": ["xla", "pallas"], "both": ["xla", "pallas"]}[
               args.implementation]
  calls = args.calls or (3 if gpu else 1)
  cache_bytes = args.cache_bytes if args.cache_bytes is not None else (
      int(2e8) if gpu else 0)
  torch = _import_torch(args)
  device = jax.devices()[0]
  meta = {"backend": jax.default_backend(),
          "device": getattr(device, "device_kind", str(device)),
          "jax": jax.__version__, "calls": calls, "repeats": args.repeats,
          "date": datetime.date.today().isoformat(),
          "cache_bytes": cache_bytes, "density": args.density,
          "levels": args.levels, "bucket_size": args.bucket_size,
          "torch": None if torch is None else torch.__version__}
  print(" ".join(f"{k}={v}" for k, v in meta.items()))
  print(HEADER)
  run = _Run(args=args, gpu=gpu, calls=calls, meta=meta)
  for dname in args.dtype:
    dtype = DTYPES[dname]
    itemsize = jnp.dtype(dtype).itemsize
    for n in args.sizes:
      copies = min(16, max(4 if gpu else 1,
                           math.ceil(cache_bytes / (n * itemsize))))
      xs = [jax.random.normal(jax.random.key(i), (n,), jnp.float32)
            .astype(dtype) for i in range(copies)]
      k = max(1, int(n * args.density))
      base = _time_baselines(run, torch, dname, n, k, xs)
      for op in args.ops:
        _time_op(run, op, impls, dname, n, k, xs, base)
      del xs
  if args.json:
    print(f"wrote {args.json}")
  return 0


if __name__ == "__main__":
  assert __doc__ is not None  # the module's docstring
  _parser = argparse.ArgumentParser(
      prog="python benchmarks/kernels_bench.py",
      description=__doc__.split("\n\n")[0])
  add_arguments(_parser)
  sys.exit(main(_parser.parse_args()) or 0)
