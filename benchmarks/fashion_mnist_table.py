"""The README's Fashion-MNIST table, from the example's own command.

Runs ``python -m examples.fashion_mnist.main --compressor=<name> <flags>
--no-progress`` for every row (default flags otherwise: 2 epochs, global
batch 256, Adam 2e-3, 8 simulated CPU devices), keeps each run's output in
``--log``, and prints the table's rows:

  python benchmarks/fashion_mnist_table.py --log benchmarks/results/fashion_mnist_default_runs.txt
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# (compressor, flags, description): the README's rows, in its order.
ROWS = [
    ("identity", "", "`identity` (dense float32 `pmean`)"),
    ("bf16", "", "`bf16`"),
    ("fp16", "", "`fp16`"),
    ("topk", "--ratio=0.01", "`topk` + residual EF"),
    ("random_block", "--ratio=0.01", "`random_block` + residual EF"),
    ("qsgd", "", "`qsgd` (two-phase all-reduce)"),
    ("sign", "", "`sign` + residual EF (EF-signSGD)"),
    ("majority_vote", "", "`majority_vote`"),
    ("onebit", "", "`onebit` + residual EF"),
    ("terngrad", "", "`terngrad`"),
    ("int8_block", "--bits=8 --block-size=256", "`int8_block` (two-phase all-reduce)"),
    ("fp8_block", "--format=e4m3 --block-size=256", "`fp8_block` (two-phase all-reduce)"),
    ("random_k", "--ratio=0.01", "`random_k` + residual EF"),
    ("threshold", "--threshold=1e-3 --ratio=0.01", "`threshold` + residual EF"),
    ("dgc", "--ratio=0.01", "`dgc` + residual EF"),
    ("powersgd", "--rank=2", "`powersgd` + residual EF (per tensor)"),
]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--log", required=True, help="append each run's output here")
  ap.add_argument("--only", nargs="*", help="compressor names to run")
  args = ap.parse_args(argv)
  rows = []
  for name, flags, desc in ROWS:
    if args.only and name not in args.only:
      continue
    cmd = [sys.executable, "-m", "examples.fashion_mnist.main",
           f"--compressor={name}", *flags.split(), "--no-progress"]
    out = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    with open(args.log, "a") as f:
      f.write(f"== {name} {flags}\n{out.stdout}{out.stderr[-2000:]}")
    acc = re.findall(r"test accuracy ([0-9.]+)", out.stdout)
    sent = re.search(r"bytes sent per device per step: (\d+) \(dense (\d+), "
                     r"compression ([0-9.]+)x; on the wire (\d+), "
                     r"compression ([0-9.]+)x", out.stdout)
    if out.returncode or not acc or not sent:
      print(f"| {desc} | `{flags}` | FAILED (exit {out.returncode}) | | | |",
            flush=True)
      continue
    b, dense, comp, wire, wcomp = sent.groups()
    print(f"| {desc} | {f'`{flags}`' if flags else ''} | {acc[-1]} | "
          f"{int(b):,} | {float(comp):.1f}x | {float(wcomp):.1f}x |",
          flush=True)
    rows.append(name)
  return 0


if __name__ == "__main__":
  sys.exit(main())
