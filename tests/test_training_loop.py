"""docs/training_loop.md: every recipe runs as written, each in a fresh
process on 8 simulated CPU devices, and the page's table of idioms lists
exactly those recipes.

``python tests/test_training_loop.py`` runs every recipe and prints the
page's table with what each run found.
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "training_loop.md"

# The table's words for each recipe: the idiom and the change it takes.
IDIOMS = {
    "shard_map": ("`jax.shard_map` step", "`jaxcomp.make_train_step`"),
    "shard_map_by_hand": ("per-device step by hand",
                          "`per_device_value_and_grad` for `jax.value_and_grad`"),
    "pmap": ("`jax.pmap`", "none (the chain in `tx`)"),
    "jit": ("`jax.jit` on a sharded batch",
            "the gradient line: `compressed_value_and_grad`"),
    "nnx": ("Flax NNX `nnx.Optimizer`",
            "`jaxcomp.flax.Optimizer`, `jaxcomp.flax.train_step`"),
    "linen": ("Flax Linen `TrainState`",
              "`jaxcomp.flax.create_train_state`, `train_state_step`"),
    "multi_steps": ("`optax.MultiSteps`",
                    "`jaxcomp.multi_steps(tx, k)`: exchanges once per k"),
    "apply_if_finite": ("`optax.apply_if_finite`",
                        "`jaxcomp.apply_if_finite(tx, axis_name)`"),
    "masked": ("`optax.masked`", "`compressed_mean(mask=...)`"),
    "bf16": ("bfloat16 model", "none: gradients travel in bfloat16"),
}


def blocks():
  """``(setup, {recipe name: code})`` from the doc's python blocks."""
  text = DOC.read_text()
  setup = re.search(r"```python setup\n(.*?)```", text, re.S).group(1)
  recipes = dict(re.findall(r"```python recipe=(\w+)\n(.*?)```", text, re.S))
  return setup, recipes


def run_recipe(name: str) -> subprocess.CompletedProcess:
  setup, recipes = blocks()
  script = "\n".join([
      "import os",
      "os.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=8'",
      setup, recipes[name], "print('recipe ok')"])
  env = dict(os.environ, PYTHONPATH=str(ROOT))
  return subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                        capture_output=True, text=True, timeout=600)


def table(status: dict[str, str]) -> str:
  rows = ["| idiom | the change | status |", "| --- | --- | --- |"]
  for name, (idiom, change) in IDIOMS.items():
    rows.append(f"| {idiom} | {change} | {status[name]} |")
  return "\n".join(rows)


def test_every_recipe_has_a_row():
  _, recipes = blocks()
  assert list(recipes) == list(IDIOMS)


def test_page_table_is_the_recipes():
  assert table({n: "runs" for n in IDIOMS}) in DOC.read_text()


@pytest.mark.parametrize("name", list(IDIOMS))
def test_recipe_runs(name):
  out = run_recipe(name)
  assert out.returncode == 0 and "recipe ok" in out.stdout, out.stderr[-4000:]


if __name__ == "__main__":
  results = {}
  for recipe in IDIOMS:
    done = run_recipe(recipe)
    results[recipe] = "runs" if done.returncode == 0 else "FAILS"
    print(recipe, results[recipe], file=sys.stderr, flush=True)
  print(table(results))
