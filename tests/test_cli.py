"""The one ``jaxcomp`` command line: ``jaxcomp --help`` lists every
subcommand and each subcommand's ``--help`` runs (here and as ``python -m
jaxcomp.cli``; tests/test_packaging.py does the same from the installed
wheel), and ``jaxcomp autotune`` writes and shows its table."""

import json
import os
import pathlib
import re
import subprocess
import sys

import pytest

from jaxcomp import cli
from jaxcomp import kernels

ROOT = pathlib.Path(__file__).resolve().parents[1]

SUBCOMMANDS = ("whatif", "launch", "islands", "lighthouse", "autotune")


def expected_subcommands() -> list[str]:
  """The subcommands ``jaxcomp --help`` must list."""
  return list(SUBCOMMANDS)


def listed_subcommands(help_text: str) -> list[str]:
  """The subcommand names of ``jaxcomp --help``'s COMMAND list."""
  return re.findall(r"^    (\w[\w-]*)\b", help_text, re.M)


def test_help_lists_every_subcommand_as_python_m_jaxcomp_cli():
  env = {**os.environ, "PYTHONPATH": str(ROOT), "JAX_PLATFORMS": "cpu"}
  r = subprocess.run([sys.executable, "-m", "jaxcomp.cli", "--help"],
                     capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
  assert r.returncode == 0, r.stderr
  assert r.stdout.startswith("usage: jaxcomp"), r.stdout
  assert listed_subcommands(r.stdout) == expected_subcommands(), r.stdout


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_each_subcommand_help_runs(sub, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main([sub, "--help"])
  assert e.value.code == 0
  assert f"usage: jaxcomp {sub}" in capsys.readouterr().out


def test_launch_without_a_command_is_a_usage_error(capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["launch", "-n", "2"])
  assert e.value.code == 2
  assert "no command: put it after '--'" in capsys.readouterr().err


def test_autotune_writes_and_shows_the_table_of_a_simulated_gpu(tmp_path, capsys):
  """On a simulated GPU (the Pallas kernels in interpret mode) every
  candidate is timed for real, the choice lands in the cache file, and
  ``--show`` reads it back without timing anything."""
  cache, out_json = tmp_path / "autotune.json", tmp_path / "decisions.json"
  assert cli.main(["autotune", "--simulate", "--ops", "sign", "--sizes", "2**12",
                   "--cache", str(cache), "--json", str(out_json)]) == 0
  out = capsys.readouterr().out
  assert "device: simulated GPU" in out and str(cache) in out, out
  (row,) = json.loads(out_json.read_text())["decisions"]
  assert row["source"] == "measured" and row["from"] == "sign encode, n=4,096", row
  assert {"xla", "mosaic"} <= set(row["seconds"]), row
  assert all(t > 0 for t in row["seconds"].values()), row
  assert "| xla ms | mosaic ms |" in out and "| xla / choice |" in out, out
  assert f"| {row['key']} | sign encode, n=4,096 | {row['implementation']} |" in out, out
  tables = json.loads(cache.read_text())["tables"]
  assert [list(t) for t in tables.values()] == [[row["key"]]], tables

  assert cli.main(["autotune", "--simulate", "--show", "--cache", str(cache)]) == 0
  shown = capsys.readouterr().out
  assert f"| {row['key']} | cache file | {row['implementation']} |" in shown, shown


@pytest.mark.skipif(kernels.nvidia_gpu(), reason="off NVIDIA GPUs only")
def test_autotune_off_gpus_times_nothing(tmp_path, capsys):
  assert cli.main(["autotune", "--ops", "sign", "--sizes", "1e3",
                   "--cache", str(tmp_path / "c.json")]) == 0
  out = capsys.readouterr().out
  assert "not an NVIDIA GPU" in out and "nothing is tuned" in out, out
  assert not (tmp_path / "c.json").exists()
  assert cli.main(["autotune", "--show", "--cache", str(tmp_path / "c.json")]) == 0
  assert "no entries" in capsys.readouterr().out


@pytest.mark.parametrize("argv,message", [
    (["--sizes", "0"], "element count >= 1"),
    (["--sizes", "2**x"], "element count >= 1"),
    (["--show", "--cache", "none"], "--show reads the cache file"),
])
def test_autotune_bad_input(argv, message, capsys):
  with pytest.raises(SystemExit) as e:
    cli.main(["autotune", *argv])
  assert e.value.code == 2
  assert message in capsys.readouterr().err
