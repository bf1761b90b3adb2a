"""The package a user installs: ``python -m build`` makes an sdist and a
wheel that ``twine check`` passes, and the wheel, installed into a fresh
virtual environment outside the checkout, imports, trains and runs its
command line: ``jaxcomp --help`` lists every subcommand and each
subcommand's ``--help`` runs.

The fresh environment gets every dependency the wheel declares from the
package index, through pip's cache (the README's test command has just
filled it with the same releases), so a dependency the wheel forgets to
declare fails here. Two things keep it quick without changing what is
installed: the environment is made without its own pip (this pip installs
into it with ``--python``) and nothing is byte-compiled at install time
(``--no-compile``; Python compiles what it imports).
"""

import os
import pathlib
import re
import shutil
import subprocess
import sys
import textwrap
import tomllib

import jaxcomp
from tests.test_cli import expected_subcommands
from tests.test_cli import listed_subcommands

ROOT = pathlib.Path(__file__).resolve().parents[1]

# What the build reads from the checkout (pyproject.toml, MANIFEST.in).
BUILD_INPUTS = ["pyproject.toml", "README.md", "CHANGELOG.md", "MANIFEST.in",
                "jaxcomp"]


def _run(cmd, **kw):
  out = subprocess.run(cmd, capture_output=True, text=True, **kw)
  assert out.returncode == 0, (
      f"{' '.join(map(str, cmd))} exited {out.returncode}:\n"
      f"{out.stdout[-3000:]}\n{out.stderr[-3000:]}")
  return out


def build(tmp_path):
  """``python -m build`` of a copy of the checkout's build inputs (so the
  build writes nothing into the checkout): the sdist and the wheel built
  from it, in the returned folder."""
  src = tmp_path / "src"
  src.mkdir()
  for name in BUILD_INPUTS:
    path = ROOT / name
    if path.is_dir():
      shutil.copytree(path, src / name,
                      ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    else:
      shutil.copy2(path, src / name)
  out = src / "dist"
  _run([sys.executable, "-m", "build", "--outdir", str(out), str(src)],
       timeout=600)
  return out


def test_wheel_builds_passes_twine_and_trains_in_a_fresh_venv(tmp_path):
  # One test, one build: the checks below share it (about 10 s).
  dist = build(tmp_path)
  check_build(dist)
  check_fresh_venv(dist, tmp_path)


def check_build(dist):
  """An sdist and a wheel that ``twine check --strict`` accepts, with the
  whole package and py.typed in the wheel and no tests, docs or examples."""
  version = jaxcomp.__version__
  wheel = dist / f"jaxcomp-{version}-py3-none-any.whl"
  sdist = dist / f"jaxcomp-{version}.tar.gz"
  assert wheel.is_file() and sdist.is_file(), sorted(os.listdir(dist))
  _run([sys.executable, "-m", "twine", "check", "--strict", str(wheel),
        str(sdist)], timeout=120)
  import tarfile
  import zipfile
  names = zipfile.ZipFile(wheel).namelist()
  for required in ("jaxcomp/py.typed", "jaxcomp/kernels/qsgd.py",
                   "jaxcomp/compressors/topk.py", "jaxcomp/perfmodel/profiles.py",
                   "jaxcomp/cli.py"):
    assert required in names, required
  assert not any(n.startswith(("tests/", "docs/", "examples/", "benchmarks/",
                                "jaxcomp/bench/")) for n in names), names
  with tarfile.open(sdist) as tar:
    members = tar.getnames()
  assert f"jaxcomp-{version}/CHANGELOG.md" in members
  assert f"jaxcomp-{version}/jaxcomp/py.typed" in members


def check_fresh_venv(dist, tmp_path):
  """The wheel in a fresh venv outside the checkout: imports from there,
  trains 3 compressed steps, and its ``jaxcomp`` lists every subcommand and
  runs each one's ``--help``."""
  venv = tmp_path / "venv"
  _run([sys.executable, "-m", "venv", "--without-pip", str(venv)], timeout=120)
  python = venv / "bin" / "python"
  wheel = next(dist.glob("jaxcomp-*.whl"))
  _run([sys.executable, "-m", "pip", "--python", str(python), "install",
        "--no-compile", "--quiet", str(wheel)], timeout=900)

  work = tmp_path / "work"   # outside the checkout; nothing of it on the path
  work.mkdir()
  env = {k: v for k, v in os.environ.items()
         if k not in ("PYTHONPATH", "PYTHONHOME", "PYTHONSTARTUP")}
  env["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
  script = textwrap.dedent("""
      import importlib.metadata, pathlib, sys
      import jax, jax.numpy as jnp, optax
      from jax.sharding import NamedSharding, PartitionSpec as P
      import jaxcomp, jaxcomp.kernels, jaxcomp.compressors
      import jaxcomp.kernels.qsgd, jaxcomp.kernels.topk

      venv = pathlib.Path(sys.argv[1]).resolve()
      for m in (jaxcomp, jaxcomp.kernels, jaxcomp.compressors):
        assert venv in pathlib.Path(m.__file__).resolve().parents, m.__file__
      assert importlib.metadata.version("jaxcomp") == jaxcomp.__version__

      mesh = jax.make_mesh((8,), ("data",))
      params = {"w": jnp.zeros((16, 4)), "b": jnp.zeros((4,))}
      x = jax.random.normal(jax.random.key(0), (64, 16))
      y = x @ jnp.ones((16, 4))
      def loss_fn(p, batch):
        x, y = batch
        return jnp.mean((x @ p["w"] + p["b"] - y) ** 2)
      tx = optax.chain(jaxcomp.compressed_mean("topk", "data", ratio=0.25),
                       optax.adam(1e-1))
      state = jaxcomp.init(tx, params, mesh)
      step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh)
      batch = jax.device_put((x, y), NamedSharding(mesh, P("data")))
      losses = []
      for _ in range(3):
        state, loss = step(state, batch)
        losses.append(float(loss))
      assert losses[-1] < losses[0], losses
      stats = jaxcomp.get_stats(state.opt_state)
      assert float(stats.bytes_sent) < float(stats.dense_bytes)
      print("trained", jaxcomp.__version__, losses)
      """)
  out = _run([str(python), "-I", "-c", script, str(venv)], cwd=work, env=env,
             timeout=600)
  assert f"trained {jaxcomp.__version__}" in out.stdout

  check_command_line(venv / "bin" / "jaxcomp", work, env)


def check_command_line(jaxcomp_script, work, env):
  """``jaxcomp --help`` (the installed console script, run outside the
  checkout) lists every subcommand, and each ``jaxcomp <sub> --help`` exits
  0 with its usage."""
  top = _run([str(jaxcomp_script), "--help"], cwd=work, env=env, timeout=120)
  assert listed_subcommands(top.stdout) == expected_subcommands(), top.stdout
  helps = {}
  for sub in expected_subcommands():
    helps[sub] = _run([str(jaxcomp_script), sub, "--help"], cwd=work, env=env,
                      timeout=120).stdout
    assert f"usage: jaxcomp {sub}" in helps[sub], helps[sub]
  assert "--profile" in helps["whatif"]
  assert "-- command" in helps["launch"].splitlines()[0]
  assert "--show" in helps["autotune"]


def test_version_has_one_source():
  """pyproject.toml reads the version from jaxcomp.__version__; the
  changelog has a section for it."""
  project = tomllib.loads((ROOT / "pyproject.toml").read_text())
  assert "version" not in project["project"]
  assert "version" in project["project"]["dynamic"]
  attr = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
  assert attr == "jaxcomp.__version__"
  assert re.fullmatch(r"\d+\.\d+\.\d+", jaxcomp.__version__)
  changelog = (ROOT / "CHANGELOG.md").read_text()
  assert f"\n## {jaxcomp.__version__}\n" in changelog


def test_test_extra_carries_the_docs_extra():
  """The README's test command installs `.[test]` and the suite builds the
  docs, so every `docs` requirement is in `test` too."""
  extras = tomllib.loads((ROOT / "pyproject.toml").read_text())[
      "project"]["optional-dependencies"]
  assert set(extras["docs"]) <= set(extras["test"])
