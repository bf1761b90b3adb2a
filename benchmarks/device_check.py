"""One command that checks a GPU end to end, run from a source checkout:
``python benchmarks/device_check.py [--budget 600] [--output-dir DIR]``.

Within a wall-time budget (``--budget``, default 600 s: 10 minutes on an
H100) it runs, in this order, each section in a process of its own:

1. **tests**: the compiled (non-interpret) kernel tests
   (``tests/test_kernels.py::TestKernelsCompiled``, the Triton kernels'
   ``TestTritonCompiled`` and ``TestTritonSelectCompiled``,
   ``tests/test_backend_paths.py``, and the autotuner's own tests, its
   measurement on this GPU included), with ``--workers`` pytest workers
   (default 8, or the cores if fewer) sharing the GPU
   (``XLA_PYTHON_CLIENT_PREALLOCATE=false``): compiling kernels dominates;
2. **suite**: the whole CPU test suite under this machine's JAX
   (``JAX_PLATFORMS=cpu``, one pytest worker per core): what CI runs, on the
   JAX the GPU image ships;
3. **kernels**: the kernel benchmark against XLA (and ``torch.topk`` when
   PyTorch is importable): ``python benchmarks/kernels_bench.py
   --implementation both [--torch]`` at 2.5e7, 1e8 and 1e6 float32 and
   bfloat16 elements, in that order (:data:`KERNEL_SIZES`,
   :data:`KERNEL_OPS`: a run cut short by the budget has the sizes the
   kernels are judged at). Its top-k rows (exact and sampled) are compared with the
   latest earlier table of the same device kind under ``--baseline-dir``
   (default ``benchmarks/results`` of the checkout: every ``kernels*.json``
   there, the latest by the date in its folder's name or its rows' meta,
   this run's own folder excepted), and every row more than
   :data:`REGRESSION` slower than there is listed in the summary;
4. **examples**: one compressed train step of each example
   (``examples/multihost``, ``examples/fashion_mnist`` on its bundled
   digits, ``examples/char_lm``) with top-k, then, as the budget allows, with
   QSGD, sign, int8 and fp8 blocks; ``implementation=None`` autotunes
   their buckets into a fresh cache file;
5. **autotune**: the autotuner's table: every key the example steps
   measured, and each kernel compressor's encode at 2^20 and 2^24
   elements (what ``jaxcomp autotune`` tunes, with its functions), with the
   time of each candidate (XLA, Mosaic GPU, Triton where the dispatch takes
   it) and the choice.

The kernels' check alone, with the benchmark first in line for time (the
compiled tests, the benchmark at 2.5e7 and 1e8 elements with
``torch.topk``, the autotuner's table), within 10 minutes::

  python benchmarks/device_check.py --budget 560 \
      --sections tests kernels autotune --kernel-sizes 2.5e7 1e8 \
      --shares tests=0.3 kernels=0.55 autotune=0.15

Each section gets a share of what is left of the budget (25, 30, 20, 15 and
10 percent of it, what one leaves unused passing on); a section that runs
out is stopped and reported, and what does not fit is skipped. On an H200
with JAX 0.11.2 (2026-11-27) the compiled tests took about 4 s each, most of
it compiling kernels: 89 of the 107 ran in 340 s serially, 107 in about
100 s with 8 workers; the whole CPU suite took 3.6 min with 15 workers
(results in ``benchmarks/results/nvidia-h200-2026-11-27/``). Everything goes
under ``<output-dir>/<device kind>-<date>/`` (default output dir
``benchmarks/results``)::

  summary.md       the device, versions, command, and a table per section
  device.json      the same as data
  tests.txt        pytest's output (and tests.xml, its JUnit report;
                   tests_progress.txt: each test's outcome and seconds,
                   and a failure's traceback, written as it ends)
  kernels.txt      the benchmark's table (and kernels.json, its rows)
  examples.txt     each example run's output
  autotune.txt     the autotuner's table (and autotune.json; the cache
                   file the runs filled: autotune_cache.json)

The command exits 1 if a kernel test fails (or none ran, or a section
failed), 0 otherwise. Run it from a source checkout (it needs ``tests/`` and
``examples/``); a section whose files are missing is skipped.

Off NVIDIA GPUs (or with ``--form interpret``) it runs a short form, which
CI runs as a test (``tests/test_device_check.py``) so that the command
cannot rot: one kernel test in interpret mode, two quick tests of the suite
on two workers, the sign and int8 XLA rows of
the benchmark at 16,384 elements, one top-k train step of the multi-host
example's MLP in one process, and the autotuner's table for sign and int8
blocks on a simulated GPU (the Pallas candidates in interpret mode, timed for
real at 4,096 elements).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.util
import json
import os
import re
import shlex
import subprocess
import sys
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))  # the checkout's jaxcomp

from jaxcomp import autotune
from jaxcomp import kernels

SECTIONS = ("tests", "suite", "kernels", "examples", "autotune")
SHARES = {"tests": 0.25, "suite": 0.30, "kernels": 0.20, "examples": 0.15,
          "autotune": 0.10}
COMPILED_TESTS = ["tests/test_kernels.py::TestKernelsCompiled",
                  "tests/test_kernels_triton.py::TestTritonCompiled",
                  "tests/test_kernels_triton_topk.py::TestTritonSelectCompiled",
                  "tests/test_backend_paths.py", "tests/test_autotune.py"]
# The kernels section's sizes and ops, in the order they run (a section cut
# short by the budget keeps the rows before): the sizes and ops the kernel
# targets are stated at first (top-k and int8 blocks at 2.5e7 and 1e8).
KERNEL_SIZES = ("2.5e7", "1e8", "1e6")
KERNEL_OPS = ("topk", "int8", "fp8", "sign", "qsgd", "sampled_topk")
INTERPRET_TESTS = [
    "tests/test_kernels.py::TestKernelsInterpret::test_int8_round_half_to_even"]
SUITE = ["tests"]
INTERPRET_SUITE = [
    "tests/test_readme.py::test_readme_opens_with_two_setup_commands",
    "tests/test_readme.py::test_ci_runs_the_readme_test_command"]
COMPILED_WORKERS = 8  # pytest workers of the compiled tests, at most
EXAMPLE_COMPRESSORS = ("topk", "qsgd", "sign", "int8_block", "fp8_block")
AUTOTUNE_OPS = ("topk", "qsgd", "sign", "int8_block", "fp8_block")
INTERPRET_AUTOTUNE_OPS = ("sign", "int8_block")
# A kernels row this much slower than the same row of the latest earlier
# table of the same device kind is listed as a regression.
REGRESSION = 0.10
REGRESSION_OPS = ("topk", "sampled_topk")


def _share(text: str) -> tuple[str, float]:
  """An argparse type: ``SECTION=FRACTION`` with a fraction > 0."""
  name, _, value = text.partition("=")
  try:
    fraction = float(value)
  except ValueError:
    fraction = 0.0
  if name not in SECTIONS or fraction <= 0:
    raise argparse.ArgumentTypeError(
        f"a share is SECTION=FRACTION with SECTION one of {SECTIONS} and a "
        f"fraction > 0, got {text!r}")
  return name, fraction


def add_arguments(parser: argparse.ArgumentParser) -> None:
  parser.add_argument("--budget", type=float, default=600.0,
                      help="wall-time budget in seconds (default 600)")
  parser.add_argument("--output-dir", default=os.path.join("benchmarks",
                                                           "results"),
                      help="results go to <output-dir>/<device>-<date>/")
  parser.add_argument("--form", choices=("auto", "compiled", "interpret"),
                      default="auto", help="auto: compiled on an NVIDIA GPU, "
                      "else the short interpret-mode form")
  parser.add_argument("--sections", nargs="+", choices=SECTIONS,
                      default=list(SECTIONS), help="run only these")
  parser.add_argument("--tests", nargs="+", default=None,
                      help="pytest targets instead of the form's kernel tests")
  parser.add_argument("--workers", type=int, default=None,
                      help="pytest workers of the tests section (default "
                      f"{COMPILED_WORKERS}, or the cores if fewer; 1 in the "
                      "interpret form); the suite takes one per core")
  parser.add_argument("--kernel-sizes", nargs="+", default=list(KERNEL_SIZES),
                      metavar="N", help="element counts of the kernels "
                      f"section, in order (default: {' '.join(KERNEL_SIZES)})")
  parser.add_argument("--shares", nargs="+", default=[], metavar="SECTION=F",
                      type=_share, help="a section's share of the budget "
                      "instead of the default (e.g. kernels=0.6); shares are "
                      "taken relative to those of the sections that run")
  parser.add_argument("--baseline-dir", default=None,
                      help="earlier kernels tables (kernels*.json) that the "
                      "kernels section compares its top-k rows with "
                      "(default: <root>/benchmarks/results)")
  parser.add_argument("--root", default=None,
                      help="the source checkout (default: the one holding "
                      "this script, else the current directory)")
  parser.add_argument("--section", default=None, help=argparse.SUPPRESS)
  parser.add_argument("--run-dir", default=None, help=argparse.SUPPRESS)


@dataclasses.dataclass
class Result:
  """One section's outcome, for the summary."""
  section: str
  status: str  # "passed", "failed", "done", "skipped: ...", "stopped: ..."
  seconds: float = 0.0
  detail: str = ""
  table: str = ""  # markdown, printed under the summary's table

  @property
  def failed(self) -> bool:
    return self.status.startswith(("failed", "stopped"))


def _root(args) -> str:
  if args.root:
    return os.path.abspath(args.root)
  here = os.path.dirname(HERE)
  if os.path.isdir(os.path.join(here, "tests")):
    return here
  return os.getcwd()


def _slug(text: str) -> str:
  return re.sub(r"[^a-z0-9]+", "-", text.lower()).strip("-") or "device"


def _env(root: str) -> dict[str, str]:
  env = dict(os.environ)
  env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
  return env


def _run(cmd: list[str], *, root: str, timeout: float, log: str,
         env: dict[str, str] | None = None) -> tuple[int | None, float, str]:
  """Runs ``cmd`` in ``root``, its output appended to ``log``; returns
  ``(exit code or None when stopped at timeout, seconds, output)``."""
  start = time.monotonic()
  try:
    proc = subprocess.run(cmd, cwd=root, env=env or _env(root),
                          capture_output=True, text=True,
                          timeout=max(1.0, timeout))
    code, out = proc.returncode, proc.stdout + proc.stderr
  except subprocess.TimeoutExpired as e:
    code = None
    out = ((e.stdout or b"").decode(errors="replace") if isinstance(
        e.stdout, bytes) else (e.stdout or "")) + ((e.stderr or b"").decode(
            errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or ""))
  seconds = time.monotonic() - start
  with open(log, "a", encoding="utf-8") as f:
    f.write(f"$ {' '.join(cmd)}\n{out}\n[exit {code}, {seconds:.1f} s]\n\n")
  return code, seconds, out


def _probe(root: str) -> dict[str, Any]:
  """The device and versions, read in a process of its own (this one
  starts no backend, so that it holds no GPU memory while the sections
  run)."""
  # jaxcomp's version from the package itself: a source checkout on
  # PYTHONPATH has no installed metadata.
  code = ("import json, jax, importlib.metadata as m, jaxcomp\n"
          "from jaxcomp import kernels\n"
          "d = jax.devices()[0]\n"
          "v = lambda p: m.version(p)\n"
          "print(json.dumps({'device_kind': str(getattr(d, 'device_kind', d.platform)),"
          " 'platform': d.platform, 'device_count': jax.device_count(),"
          " 'nvidia_gpu': kernels.nvidia_gpu(), 'jax': jax.__version__,"
          " 'jaxlib': v('jaxlib'), 'jaxcomp': jaxcomp.__version__}))\n")
  out = subprocess.run([sys.executable, "-c", code], cwd=root, env=_env(root),
                       capture_output=True, text=True, timeout=300, check=True)
  return json.loads(out.stdout.strip().splitlines()[-1])


def _pytest_counts(text: str) -> dict[str, int]:
  counts = {}
  tail = [l for l in text.splitlines() if re.search(r"\d+ (passed|failed|error)", l)]
  for n, what in re.findall(r"(\d+) (passed|failed|skipped|errors?|deselected)",
                            tail[-1] if tail else ""):
    counts[what.rstrip("s") if what.startswith("error") else what] = int(n)
  return counts


def _pytest(section: str, targets: list[str], *, workers: int, root: str,
            run_dir: str, timeout: float, env: dict[str, str]) -> Result:
  """pytest over ``targets`` with ``workers`` workers (pytest-xdist where
  more than one), its output in ``<section>.txt``, its JUnit report in
  ``<section>.xml`` and each outcome as it ends in
  ``<section>_progress.txt`` (tests/conftest.py writes it)."""
  files = {t.split("::")[0] for t in targets}
  missing = [f for f in files if not os.path.exists(os.path.join(root, f))]
  if missing:
    return Result(section, f"skipped: {', '.join(sorted(missing))} not found "
                  "(run from a source checkout)")
  parallel = ["-n", str(workers)] if workers > 1 else []
  cmd = [sys.executable, "-m", "pytest", "-q", "-rfE", "-p", "no:cacheprovider",
         "--durations=20", *parallel,
         f"--junitxml={os.path.join(run_dir, f'{section}.xml')}", *targets]
  # tests/conftest.py appends each outcome, its seconds and a failure's
  # traceback as the test ends: what a run stopped at the budget ran.
  env["JAXCOMP_TEST_PROGRESS"] = os.path.join(run_dir, f"{section}_progress.txt")
  code, seconds, out = _run(cmd, root=root, timeout=timeout, env=env,
                            log=os.path.join(run_dir, f"{section}.txt"))
  counts = _pytest_counts(out)
  detail = (", ".join(f"{v} {k}" for k, v in counts.items())
            + f" ({workers} worker{'s' * (workers > 1)}; {section}.txt)")
  if code is None:
    return Result(section, "stopped: out of budget", seconds, detail)
  ran = sum(counts.get(k, 0) for k in ("passed", "failed", "error"))
  if code == 5 or ran == 0:
    return Result(section, "failed: no test ran", seconds, detail)
  return Result(section, "passed" if code == 0 else "failed", seconds, detail)


def _cores() -> int:
  return max(1, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity")
             else os.cpu_count() or 1)


def _tests(args, root, run_dir, timeout, compiled) -> Result:
  """The compiled kernel tests (a few in interpret mode off GPUs), several
  workers sharing the GPU, each allocating what it uses."""
  targets = args.tests or (COMPILED_TESTS if compiled else INTERPRET_TESTS)
  workers = args.workers or (min(COMPILED_WORKERS, _cores()) if compiled else 1)
  env = _env(root)
  env["XLA_PYTHON_CLIENT_PREALLOCATE"] = "false"
  return _pytest("tests", targets, workers=workers, root=root,
                 run_dir=run_dir, timeout=timeout, env=env)


def _suite(args, root, run_dir, timeout, compiled) -> Result:
  """The whole CPU suite under this machine's JAX (two quick tests in the
  interpret form, which itself runs inside the suite), one worker per
  core."""
  del args
  env = _env(root)
  env["JAX_PLATFORMS"] = "cpu"
  env.pop("XLA_FLAGS", None)  # tests/conftest.py sets the simulated devices
  return _pytest("suite", SUITE if compiled else INTERPRET_SUITE,
                 workers=_cores() if compiled else 2, root=root,
                 run_dir=run_dir, timeout=timeout, env=env)


_DATE_RE = re.compile(r"(\d{4}-\d\d-\d\d)")


def _table_date(path: str, meta: dict) -> str:
  """A kernels table's date: the one in its folder's name (``<device>-<date>``),
  else its meta's ``date``, else "" (older than every dated one)."""
  found = _DATE_RE.search(os.path.basename(os.path.dirname(path)))
  return found.group(1) if found else str(meta.get("date") or "")


def previous_kernels_table(baseline_dir: str, device: str,
                           exclude: str | None = None) -> str | None:
  """The latest kernels table of ``device`` under ``baseline_dir``.

  Args:
    baseline_dir: a folder of results: its ``kernels*.json`` files and those
      one folder down (``<device>-<date>/kernels.json``) are read.
    device: the device kind, as the benchmark's meta names it
      (``"NVIDIA H200"``).
    exclude: a folder whose tables are not candidates (this run's own).

  Returns:
    The path of the table whose meta names ``device`` with the latest date
    (:func:`_table_date`; ties: the latest path), or None.
  """
  paths = []
  for base, dirs, files in os.walk(baseline_dir):
    dirs[:] = [] if base != baseline_dir else sorted(dirs)
    if exclude and os.path.abspath(base) == os.path.abspath(exclude):
      continue
    paths += [os.path.join(base, f) for f in files
              if f.startswith("kernels") and f.endswith(".json")]
  found = []
  for path in paths:
    try:
      with open(path, encoding="utf-8") as f:
        meta = json.load(f)["meta"]
    except (OSError, ValueError, KeyError, TypeError):
      continue
    if meta.get("device") == device:
      found.append((_table_date(path, meta), path))
  return max(found)[1] if found else None


def kernel_regressions(new_rows: list[dict], old_rows: list[dict], *,
                       threshold: float = REGRESSION,
                       ops=REGRESSION_OPS) -> tuple[list[dict], int]:
  """The rows of ``ops`` in ``new_rows`` more than ``threshold`` slower
  than the same row (dtype, op, implementation, n) of ``old_rows``.

  Returns:
    ``(regressions, compared)``: each regression the new row with
    ``before`` (the old seconds) and ``slower`` (new / old - 1), slowest
    first; ``compared`` the rows timed in both tables.
  """
  key = lambda r: (r.get("dtype"), r.get("op"), r.get("impl"), r.get("n"))
  old = {key(r): r["seconds"] for r in old_rows
         if r.get("op") in ops and r.get("seconds")}
  out, compared = [], 0
  for r in new_rows:
    before = old.get(key(r))
    if r.get("op") not in ops or not r.get("seconds") or not before:
      continue
    compared += 1
    slower = r["seconds"] / before - 1
    if slower > threshold:
      out.append({**r, "before": before, "slower": slower})
  return sorted(out, key=lambda r: -r["slower"]), compared


def kernels_summary(run_dir: str, baseline_dir: str, root: str
                    ) -> tuple[int, str, str]:
  """What the summary shows of this run's ``kernels.json``: ``(rows,
  markdown table, a line on the comparison with the latest earlier table
  of the same device kind)``.

  Raises:
    OSError, ValueError, KeyError: no readable ``kernels.json`` in
      ``run_dir``.
  """
  with open(os.path.join(run_dir, "kernels.json"), encoding="utf-8") as f:
    data = json.load(f)
  rows = data["rows"]
  lines = ["| dtype | op | implementation | n | ms | GB/s | vs XLA reference |",
           "| --- | --- | --- | --- | --- | --- | --- |"]
  for r in rows:
    ms = "failed" if r["seconds"] is None else f"{r['seconds'] * 1e3:.3f}"
    gbs = "" if r["seconds"] is None else f"{r['gb_per_s']:.1f}"
    ref = r.get("ratio_ref")
    lines.append(f"| {r['dtype']} | {r['op']} | {r['impl']} | {r['n']:,} | "
                 f"{ms} | {gbs} | {'' if ref is None else f'{ref:.2f}x'} |")
  device = data.get("meta", {}).get("device", "")
  previous = previous_kernels_table(baseline_dir, device, exclude=run_dir)
  if previous is None:
    return len(rows), "\n".join(lines), (
        f"no earlier kernels table of {device} under "
        f"{os.path.relpath(baseline_dir, root)}")
  with open(previous, encoding="utf-8") as f:
    regressions, compared = kernel_regressions(rows, json.load(f)["rows"])
  source = os.path.relpath(previous, root)
  line = (f"top-k rows against {source}: {compared} compared, "
          f"{len(regressions)} more than {REGRESSION:.0%} slower")
  lines += ["", f"### Regressions: top-k rows more than {REGRESSION:.0%} "
            f"slower than `{source}`", ""]
  if regressions:
    lines += ["| dtype | op | implementation | n | ms before | ms now | slower |",
              "| --- | --- | --- | --- | --- | --- | --- |"]
    lines += [f"| {r['dtype']} | {r['op']} | {r['impl']} | {r['n']:,} | "
              f"{r['before'] * 1e3:.3f} | {r['seconds'] * 1e3:.3f} | "
              f"{r['slower']:+.0%} |" for r in regressions]
  else:
    lines.append(f"None of the {compared} top-k rows timed in both tables.")
  return len(rows), "\n".join(lines), line


def _kernels(args, root, run_dir, timeout, compiled) -> Result:
  baseline_dir = args.baseline_dir or os.path.join(root, "benchmarks",
                                                   "results")
  cmd = [sys.executable, os.path.join(HERE, "kernels_bench.py"),
         "--json", os.path.join(run_dir, "kernels.json")]
  if compiled:
    cmd += ["--implementation", "both", "--sizes", *args.kernel_sizes,
            "--ops", *KERNEL_OPS, "--dtype", "f32", "bf16"]
    if importlib.util.find_spec("torch") is not None:
      cmd.append("--torch")
  else:
    cmd += ["--implementation", "xla", "--sizes", "16384", "--repeats", "2",
            "--ops", "sign", "int8"]
  log = os.path.join(run_dir, "kernels.txt")
  code, seconds, out = _run(cmd, root=root, timeout=timeout, log=log)
  rows = out.count("\n") if code == 0 else 0
  table, compared = "", ""
  try:
    rows, table, compared = kernels_summary(run_dir, baseline_dir, root)
    compared = f"; {compared}"
  except (OSError, ValueError, KeyError, TypeError):
    pass
  if code is None:
    return Result("kernels", "stopped: out of budget", seconds,
                  f"{rows} rows (kernels.txt){compared}", table)
  return Result("kernels", "done" if code == 0 else "failed", seconds,
                f"{rows} rows (kernels.txt, kernels.json){compared}", table)


def _example_commands(compressor: str, compiled: bool) -> list[tuple[str, list[str]]]:
  runs = [("multihost", [os.path.join("examples", "multihost", "train_mlp.py"),
                         "--steps=1", f"--compressor={compressor}"])]
  if compiled:
    runs += [("fashion_mnist", ["-m", "examples.fashion_mnist.main",
                                f"--compressor={compressor}", "--epochs=1",
                                "--max-steps=1", "--batch-size=64",
                                "--no-progress", "--dataset=digits"]),
             ("char_lm", ["-m", "examples.char_lm.main",
                          f"--compressor={compressor}", "--epochs=1",
                          "--max-steps=1", "--no-progress"])]
  return runs


def _examples(args, root, run_dir, timeout, compiled) -> Result:
  del args
  if not os.path.isdir(os.path.join(root, "examples")):
    return Result("examples", "skipped: examples/ not found (run from a "
                  "source checkout)")
  env = _env(root)
  env["JAXCOMP_AUTOTUNE_CACHE"] = os.path.join(run_dir, "autotune_cache.json")
  env.pop("JAXCOMP_KERNELS", None)
  deadline = time.monotonic() + timeout
  compressors = EXAMPLE_COMPRESSORS if compiled else EXAMPLE_COMPRESSORS[:1]
  rows, failed, skipped, start = [], 0, 0, time.monotonic()
  log = os.path.join(run_dir, "examples.txt")
  for compressor in compressors:
    for name, cmd in _example_commands(compressor, compiled):
      left = deadline - time.monotonic()
      if left < 10:
        skipped += 1
        rows.append(f"| {name} | {compressor} | skipped: budget | |")
        continue
      code, seconds, _ = _run([sys.executable, *cmd], root=root, timeout=left,
                              log=log, env=env)
      status = ("ran" if code == 0 else "stopped: budget" if code is None
                else f"failed (exit {code})")
      failed += code not in (0, None)
      rows.append(f"| {name} | {compressor} | {status} | {seconds:.1f} |")
  ran = sum("| ran |" in r for r in rows)
  table = "\n".join(["| example | compressor | one train step | seconds |",
                     "| --- | --- | --- | --- |", *rows])
  status = "failed" if failed else "passed"
  return Result("examples", status, time.monotonic() - start,
                f"{ran} of {len(rows)} ran, {failed} failed, {skipped} "
                "skipped (examples.txt)", table)


def _autotune(args, root, run_dir, timeout, compiled) -> Result:
  cmd = [sys.executable, os.path.abspath(__file__),
         "--section", "autotune", "--run-dir", run_dir,
         "--form", "compiled" if compiled else "interpret"]
  code, seconds, _ = _run(cmd, root=root, timeout=timeout,
                          log=os.path.join(run_dir, "autotune.txt"))
  table, detail = "", "autotune.txt"
  try:
    with open(os.path.join(run_dir, "autotune.json"), encoding="utf-8") as f:
      rows = json.load(f)["decisions"]
    table = autotune.autotune_table(rows)
    chosen = [r["implementation"] for r in rows]
    counts = ", ".join(f"{c} {chosen.count(c)}" for c in sorted(set(chosen)))
    detail = f"{len(rows)} keys: {counts} (autotune.txt, autotune.json)"
  except (OSError, ValueError, KeyError):
    pass
  if code is None:
    return Result("autotune", "stopped: out of budget", seconds, detail, table)
  return Result("autotune", "done" if code == 0 else "failed", seconds, detail,
                table)


def _autotune_section(run_dir: str, compiled: bool) -> int:
  """The autotune section, in this process: the keys the example steps
  measured (their cache file) and each kernel compressor's encode at a few
  sizes, under a tuner of its own (a simulated GPU in the interpret form)."""
  cache = os.path.join(run_dir, "autotune_cache.json")
  rows = []
  if compiled:
    tuner = kernels.Autotuner(cache_path=cache)
    sizes = (1 << 20, 1 << 24)
    for entry_key, entry in autotune.cache_entries(cache, tuner.table_name()):
      rows.append({"key": entry_key, "from": "example steps", **entry})
  else:
    tuner = autotune.simulated_tuner(cache)
    sizes = (4096,)
  rows += autotune.autotune_rows(
      AUTOTUNE_OPS if compiled else INTERPRET_AUTOTUNE_OPS, sizes, tuner)
  with open(os.path.join(run_dir, "autotune.json"), "w", encoding="utf-8") as f:
    json.dump({"device": tuner.device_kind, "table": tuner.table_name(),
               "decisions": rows}, f, indent=1)
  print(f"device: {tuner.device_kind}")
  print(autotune.autotune_table(rows))
  return 0


RUNNERS = {"tests": _tests, "suite": _suite, "kernels": _kernels,
           "examples": _examples, "autotune": _autotune}


def _summary(info: dict, results: list[Result], command: str) -> str:
  form = info["form"]
  lines = [f"# jaxcomp device check: {info['device_kind']}, {info['date']}", "",
           f"`{command}`, {form} form: {info['device_count']} "
           f"{info['platform']} device(s), JAX {info['jax']}, jaxlib "
           f"{info['jaxlib']}, jaxcomp {info['jaxcomp']}, budget "
           f"{info['budget']:.0f} s, {info['seconds']:.0f} s used.", "",
           "| section | status | seconds | result |", "| --- | --- | --- | --- |"]
  for r in results:
    lines.append(f"| {r.section} | {r.status} | {r.seconds:.1f} | {r.detail} |")
  for r in results:
    if r.table:
      lines += ["", f"## {r.section}", "", r.table]
  return "\n".join(lines) + "\n"


def main(args: argparse.Namespace) -> int:
  if args.section == "autotune":
    return _autotune_section(args.run_dir, args.form == "compiled")
  start = time.monotonic()
  root = _root(args)
  info = _probe(root)
  compiled = (info["nvidia_gpu"] if args.form == "auto"
              else args.form == "compiled")
  info.update(form="compiled" if compiled else "interpret",
              date=datetime.date.today().isoformat(), budget=args.budget)
  run_dir = os.path.join(os.path.abspath(args.output_dir),
                         f"{_slug(info['device_kind'])}-{info['date']}")
  os.makedirs(run_dir, exist_ok=True)
  for name in ("tests.txt", "suite.txt", "kernels.txt", "examples.txt",
               "autotune.txt", "autotune_cache.json"):
    if os.path.exists(os.path.join(run_dir, name)):
      os.remove(os.path.join(run_dir, name))
  command = " ".join(["python benchmarks/device_check.py",
                       *map(shlex.quote, getattr(args, "argv", None) or [])])
  print(f"device check of {info['device_kind']} ({info['form']} form, budget "
        f"{args.budget:.0f} s) -> {run_dir}", flush=True)
  results = []
  sections = [s for s in SECTIONS if s in args.sections]
  for i, name in enumerate(sections):
    left = args.budget - (time.monotonic() - start)
    share = dict(SHARES, **dict(args.shares))
    shares = sum(share[s] for s in sections[i:])
    timeout = left * share[name] / shares
    if timeout < 5:
      results.append(Result(name, "skipped: out of budget"))
    else:
      results.append(RUNNERS[name](args, root, run_dir, timeout, compiled))
    r = results[-1]
    print(f"{name:<9} {r.status:<24} {r.seconds:7.1f} s  {r.detail}", flush=True)
  lock = os.path.join(run_dir, "autotune_cache.json.lock")
  if os.path.exists(lock):
    os.remove(lock)
  info["seconds"] = time.monotonic() - start
  info["sections"] = [dataclasses.asdict(r) for r in results]
  info["command"] = command
  with open(os.path.join(run_dir, "device.json"), "w", encoding="utf-8") as f:
    json.dump(info, f, indent=1)
  with open(os.path.join(run_dir, "summary.md"), "w", encoding="utf-8") as f:
    f.write(_summary(info, results, command))
  print(f"wrote {os.path.join(run_dir, 'summary.md')}")
  return 1 if any(r.failed for r in results) else 0


if __name__ == "__main__":
  assert __doc__ is not None  # the module's docstring
  _parser = argparse.ArgumentParser(
      prog="python benchmarks/device_check.py",
      description=__doc__.split("\n\n")[0],
      epilog="Run it from a source checkout; see the module docstring "
      "(docs/gpu.md) for the sections and their budget.")
  add_arguments(_parser)
  _args = _parser.parse_args()
  _args.argv = sys.argv[1:]  # the command line, for the summary
  sys.exit(main(_args))
