"""``python benchmarks/device_check.py`` in its short interpret-mode form
(what it runs off NVIDIA GPUs), so that the command a GPU owner runs cannot
rot: every section runs and the results land where the docs say."""

import argparse
import json
import math
import os
import re
import subprocess
import sys

import jax
import jax.numpy as jnp

from jaxcomp.hlo import kernel_structure as structure

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import device_check  # benchmarks/device_check.py
import kernels_bench as bench_kernels  # benchmarks/kernels_bench.py


def _device_check(tmp_path, *args, timeout=900):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMP_")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  # Two simulated devices per process (the example's step has a mesh of
  # two); each process starts faster than with the tests' eight.
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "device_check.py"),
                      "--form", "interpret", "--output-dir", str(tmp_path),
                      *args], cwd=ROOT, env=env, capture_output=True,
                     text=True, timeout=timeout)
  runs = [p for p in tmp_path.iterdir() if p.is_dir() and p.name.startswith("cpu-")]
  return r, runs


def test_interpret_form_runs_every_section(tmp_path):
  r, runs = _device_check(tmp_path, "--budget", "600")
  assert r.returncode == 0, r.stdout + r.stderr
  (run,) = runs
  assert re.fullmatch(r"cpu-\d{4}-\d\d-\d\d", run.name), run.name
  summary = (run / "summary.md").read_text()
  for section in device_check.SECTIONS:
    assert re.search(rf"\| {section} \| (passed|done) \|", summary), summary
  assert "interpret form" in summary and "JAX " in summary
  assert re.search(r"\| suite \| passed \| [\d.]+ \| 2 passed \(2 workers", summary), summary
  assert "passed" in (run / "suite_progress.txt").read_text()
  for name in ("tests.txt", "tests.xml", "suite.txt", "suite.xml", "kernels.txt", "kernels.json",
               "examples.txt", "autotune.txt", "autotune.json", "device.json"):
    assert (run / name).exists(), name
  device = json.loads((run / "device.json").read_text())
  assert device["device_kind"] == "cpu" and device["form"] == "interpret"
  rows = json.loads((run / "kernels.json").read_text())["rows"]
  assert {r["op"] for r in rows} >= {"sign", "int8"}
  assert all(r["seconds"] for r in rows)
  # The autotuner's table, measured for real on the simulated GPU.
  decisions = json.loads((run / "autotune.json").read_text())["decisions"]
  assert decisions and all(d["source"] == "measured" for d in decisions)
  assert all({"xla", "mosaic"} <= set(d["seconds"])
             and all(t > 0 for t in d["seconds"].values())
             for d in decisions), decisions
  assert "| multihost | topk | ran |" in summary, summary


def test_a_failing_kernel_test_makes_it_exit_non_zero(tmp_path):
  failing = tmp_path / "t" / "test_fails.py"
  failing.parent.mkdir()
  failing.write_text("def test_kernel_is_wrong():\n  assert 1 == 2\n")
  r, (run,) = _device_check(tmp_path, "--sections", "tests", "--tests",
                            str(failing))
  assert r.returncode == 1, r.stdout + r.stderr
  summary = (run / "summary.md").read_text()
  assert "| tests | failed |" in summary and "1 failed" in summary


def test_no_test_run_is_a_failure_and_the_budget_skips(tmp_path):
  r, (run,) = _device_check(tmp_path, "--sections", "tests", "kernels",
                            "--tests", "tests/test_autotune.py::no_such_test",
                            "--budget", "600")
  assert r.returncode == 1, r.stdout + r.stderr
  assert "| tests | failed" in (run / "summary.md").read_text()
  r, (run,) = _device_check(tmp_path, "--sections", "kernels", "autotune",
                            "--budget", "1")
  assert r.returncode == 0, r.stdout + r.stderr
  summary = (run / "summary.md").read_text()
  assert "| kernels | skipped: out of budget |" in summary, summary
  assert "| autotune | skipped: out of budget |" in summary, summary


def _largest_constant(text: str) -> int:
  """Elements of the largest ``stablehlo.constant`` in a module's text."""
  sizes = [math.prod(int(d) for d in dims.split("x") if d)
           for dims in _CONSTANT_RE.findall(text)]
  return max(sizes, default=0)


_CONSTANT_RE = re.compile(r"stablehlo\.constant dense<.*?> : tensor<((?:\d+x)*)\w+>")


def test_kernel_benchmark_times_programs_without_input_sized_constants():
  """Every program the kernel benchmark times (the reference and each
  case of each op, for the GPU's program over the input copies) takes the
  arrays it reads as arguments: exported for CUDA, it holds no constant of
  1/32 of the input's size or more, so XLA has nothing input-sized to fold
  while compiling it (a closed-over uniform array, padded in the program,
  took most of 200 s of a GPU compilation at 1e8 elements)."""
  parser = argparse.ArgumentParser()
  bench_kernels.add_arguments(parser)
  args = parser.parse_args(["--implementation", "both"])
  n = 20_003  # not whole tiles: the Pallas paths pad x (and QSGD's u)
  x = jax.ShapeDtypeStruct((n,), jnp.float32)
  checked = []
  for op in bench_kernels.OPS:
    c = bench_kernels.op_cases(op, n=n, k=n // 100, itemsize=4, args=args)
    for label, fn in {"reference": c.reference, **c.cases}.items():
      program = bench_kernels.timed_program(fn)
      text = structure.export_cuda(program, c.extra, x).mlir_module()
      assert _largest_constant(text) < n // 32, (op, label)
      checked.append(f"{op} {label}")
  assert "qsgd pallas" in checked and "sampled_topk xla" in checked, checked
  assert "int8 pallas:triton" in checked and "fp8 pallas:triton" in checked
  assert {"topk pallas:triton", "sampled_topk pallas:triton",
          "sign pallas:triton", "qsgd pallas:triton"} <= set(checked), checked
  # The check sees an input-sized array that a timed function closes over.
  u = jnp.zeros((n,), jnp.float32)
  closure = bench_kernels.timed_program(jax.jit(lambda v: v + u))
  text = jax.export.export(closure, platforms=["cuda"])((), x).mlir_module()
  assert _largest_constant(text) == n


def _table(path, device, date, rows):
  path.parent.mkdir(parents=True, exist_ok=True)
  meta = {"device": device, "backend": "gpu"}
  if date:
    meta["date"] = date
  path.write_text(json.dumps({"meta": meta, "rows": [
      {"dtype": "f32", "op": op, "impl": impl, "n": n, "seconds": s,
       "gb_per_s": 1.0, "ratio_ref": None} for op, impl, n, s in rows]}))


def test_top_k_rows_slower_than_the_last_table_of_the_gpu_are_flagged(tmp_path):
  """The kernels section compares this run's top-k rows (exact and
  sampled) with the latest earlier table of the same device kind (by the
  date in its folder's name or its meta; other devices' tables and this
  run's own folder are not candidates) and lists each row more than 10%
  slower in the summary."""
  results = tmp_path / "results"
  run = results / "fake-gpu-2027-01-05"
  new = [("topk", "xla", 1_000_000, 1.2e-3),        # +20%: flagged
         ("topk", "auto", 1_000_000, 0.209e-3),     # +4.5%: not
         ("sampled_topk", "xla", 25_000_000, 0.30e-3),  # +50%: flagged
         ("topk", "pallas", 25_000_000, 0.5e-3),    # faster
         ("topk", "xla", 25_000_000, None),         # failed: not compared
         ("sign", "reference", 1_000_000, 9.0),     # not a top-k row
         ("topk", "reference", 7, 1.0)]             # not in the old table
  _table(run / "kernels.json", "Fake GPU", "2027-01-05", new)
  old = [("topk", "xla", 1_000_000, 1.0e-3), ("topk", "auto", 1_000_000, 0.2e-3),
         ("sampled_topk", "xla", 25_000_000, 0.2e-3),
         ("topk", "pallas", 25_000_000, 1.0e-3),
         ("topk", "xla", 25_000_000, 0.5e-3), ("sign", "reference", 1_000_000, 1e-3)]
  _table(results / "fake-gpu-2027-01-02" / "kernels.json", "Fake GPU", None, old)
  # Older, or another GPU's, or undated: not the baseline.
  slow = [(op, impl, n, 10.0) for op, impl, n, _ in old]
  _table(results / "fake-gpu-2026-12-01" / "kernels.json", "Fake GPU", None, slow)
  _table(results / "kernels_fake_f32.json", "Fake GPU", None, slow)
  _table(results / "other-gpu-2027-01-04" / "kernels.json", "Other GPU", None, slow)
  fast = [(op, impl, n, 1e-9) for op, impl, n, _ in old]
  _table(results / "nested" / "deeper-2027-01-04" / "kernels.json", "Fake GPU",
         None, fast)
  assert device_check.previous_kernels_table(str(results), "Fake GPU", str(run)) \
      == str(results / "fake-gpu-2027-01-02" / "kernels.json")
  assert device_check.previous_kernels_table(str(results), "No GPU") is None

  rows, table, line = device_check.kernels_summary(str(run), str(results),
                                                   str(tmp_path))
  assert rows == len(new)
  assert line == ("top-k rows against results/fake-gpu-2027-01-02/kernels.json: "
                  "4 compared, 2 more than 10% slower"), line
  flagged = re.findall(r"^\| f32 \| (\w+) \| (\w+) \| ([\d,]+) \| ([\d.]+) \| "
                       r"([\d.]+) \| \+(\d+)% \|$", table, re.M)
  assert flagged == [("sampled_topk", "xla", "25,000,000", "0.200", "0.300", "50"),
                     ("topk", "xla", "1,000,000", "1.000", "1.200", "20")], table
  summary = device_check._summary(  # pylint: disable=protected-access
      {"form": "compiled", "device_kind": "Fake GPU", "date": "2027-01-05",
       "device_count": 1, "platform": "gpu", "jax": "0", "jaxlib": "0",
       "jaxcomp": "0", "budget": 1.0, "seconds": 1.0},
      [device_check.Result("kernels", "done", 1.0, line, table)], "cmd")
  assert "### Regressions: top-k rows more than 10% slower than " \
      "`results/fake-gpu-2027-01-02/kernels.json`" in summary, summary

  # No regression, and no earlier table of the device.
  _table(run / "kernels.json", "Fake GPU", "2027-01-05", old)
  _, table, line = device_check.kernels_summary(str(run), str(results),
                                                str(tmp_path))
  assert "5 compared, 0 more than 10% slower" in line
  assert "None of the 5 top-k rows" in table
  _table(run / "kernels.json", "Lone GPU", "2027-01-05", old)
  _, table, line = device_check.kernels_summary(str(run), str(results),
                                                str(tmp_path))
  assert line == "no earlier kernels table of Lone GPU under results", line
  assert "Regressions" not in table


def test_help_names_the_command_a_checkout_runs():
  """``--help`` of both scripts runs from the checkout and names the command
  (the tooling left the installed package for benchmarks/)."""
  for script in ("device_check.py", "kernels_bench.py"):
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", script), "--help"],
                       capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    assert f"python benchmarks/{script}" in r.stdout, r.stdout
