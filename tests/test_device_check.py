"""``python -m jaxcomp.bench device-check`` in its short interpret-mode form
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

from jaxcomp.bench import device_check
from jaxcomp.bench import kernels as bench_kernels

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _device_check(tmp_path, *args, timeout=900):
  env = {k: v for k, v in os.environ.items() if not k.startswith("JAXCOMP_")}
  env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
  # Two simulated devices per process (the example's step has a mesh of
  # two); each process starts faster than with the tests' eight.
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=2"
  r = subprocess.run([sys.executable, "-m", "jaxcomp.bench", "device-check",
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
  assert all(d["seconds"]["pallas"] > 0 and d["seconds"]["xla"] > 0
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
      text = jax.export.export(program, platforms=["cuda"])(
          c.extra, x).mlir_module()
      assert _largest_constant(text) < n // 32, (op, label)
      checked.append(f"{op} {label}")
  assert "qsgd pallas" in checked and "sampled_topk xla" in checked, checked
  # The check sees an input-sized array that a timed function closes over.
  u = jnp.zeros((n,), jnp.float32)
  closure = bench_kernels.timed_program(jax.jit(lambda v: v + u))
  text = jax.export.export(closure, platforms=["cuda"])((), x).mlir_module()
  assert _largest_constant(text) == n

