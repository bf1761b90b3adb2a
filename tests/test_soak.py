"""The soak benchmark (``benchmarks/soak.py``): its short form stays flat
with every stateful configuration, and its checks catch what they are
meant to catch. The long form's table is in docs/hardening.md."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import soak  # noqa: E402  (benchmarks/soak.py)

pytest.importorskip("orbax.checkpoint")

SHORT = ["--steps", "100", "--every", "20", "--save-every", "20", "--keep",
         "2", "--short"]


def test_short_soak_stays_flat(tmp_path):
  """100 steps of each stateful configuration on 8 simulated devices, a
  checkpoint every 20 steps with 2 kept: after the warm-up no live buffer,
  compilation or retained checkpoint is added, RSS and the residuals stay
  within their bounds (a subprocess: its own 8 devices and RSS)."""
  out = tmp_path / "soak.json"
  env = {k: v for k, v in os.environ.items() if k != "XLA_FLAGS"}
  r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks",
                                                   "soak.py"), *SHORT,
                      "--json", str(out)],
                     capture_output=True, text=True, timeout=900, env=env)
  assert r.returncode == 0, r.stdout + r.stderr[-3000:]
  results = json.loads(out.read_text())["results"]
  assert [x["name"] for x in results] == list(soak.CONFIGS)
  for res in results:
    assert res["problems"] == [], (res["name"], res["problems"])
    samples = res["samples"]
    assert [s["step"] for s in samples] == list(range(20, 101, 20))
    after = [s for s in samples if s["step"] >= 40]
    assert len({s["compilations"] for s in after}) == 1, samples
    assert len({s["live_buffers"] for s in after}) == 1, samples
    assert all(s["ckpt_steps"] == 2 for s in after), samples


def _samples(n=10, **grow):
  """Flat samples every 100 steps; ``grow={key: per-sample increment}``."""
  out = []
  for i in range(n):
    s = {"step": 100 * (i + 1), "rss_mib": 500.0, "live_buffers": 300,
         "live_bytes": 10_000, "compilations": 40, "ckpt_bytes": 3000,
         "ckpt_steps": 3, "ckpt_step_bytes": 1000, "residual_norm": 1.0,
         "state_norm": 2.0, "loss": 0.1, "seconds": i}
    for key, step in grow.items():
      s[key] += step * i
    out.append(s)
  return out


def test_soak_checks_catch_an_explosion_in_a_short_run():
  args = soak.argparse.Namespace(keep=2, save_every=20, warmup=40,
                                 rss_slack=64.0)
  samples = _samples(n=5)
  for s, r in zip(samples, [1.0, 1.0, 1.0, 1.5, 4.0]):
    s.update(step=s["step"] // 5, ckpt_steps=2, ckpt_bytes=2000,
             residual_norm=r)
  problems = soak.check(samples, args)
  assert any("residual_norm grew: 4 over the last half" in p
             for p in problems), problems


@pytest.mark.parametrize("grow,words", [
    ({}, None),
    ({"rss_mib": 10.0}, "host RSS grew"),
    ({"live_buffers": 1}, "live_buffers went from 302 to 303"),
    ({"compilations": 1}, "compilations went from 42"),
    ({"ckpt_steps": 1}, "checkpoints kept, retention 3"),
    ({"ckpt_bytes": 1000}, "over 4 times its largest step"),
    ({"residual_norm": 1.0}, "residual_norm drifts up"),  # linear
    ({"state_norm": 1.0}, "state_norm drifts up"),
    ({"residual_norm": 0.01}, None),  # a few % over the run: flat enough
])
def test_soak_checks_catch_growth(grow, words):
  args = soak.argparse.Namespace(keep=3, save_every=100, warmup=200,
                                 rss_slack=64.0)
  problems = soak.check(_samples(n=12, **grow), args)
  if words is None:
    assert problems == []
  else:
    assert any(words in p for p in problems), problems
