"""DiLoCo on the character LM: validation loss against bytes over the run.

Trains ``examples.char_lm`` (8 simulated CPU devices, the example's default
model, Adam 3e-3 and steps) with dense data parallelism and with DiLoCo
(``--diloco-every H``: Adam per device, a pseudo-gradient exchange every H
steps, outer Nesterov SGD 0.7 / 0.9), its pseudo-gradients dense or
compressed, and prints one row per run: validation loss, its difference to
dense data parallelism's, bytes one device hands to collectives over the
run and the factor fewer than dense.

  python benchmarks/diloco_char_lm.py --out benchmarks/results/diloco_char_lm.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import xla_flags  # noqa: E402  (imports no jax)

# (label, Config fields): dense data parallelism first, the baseline.
RUNS = [
    ("data parallel, dense", dict(compressor="identity")),
    ("DiLoCo H=10, dense", dict(compressor="identity", diloco_every=10)),
    ("DiLoCo H=10, int8 blocks 4-bit", dict(compressor="int8_block", bits=4,
                                             diloco_every=10)),
    ("DiLoCo H=10, top-k 5% + EF", dict(compressor="topk", ratio=0.05,
                                         diloco_every=10)),
    ("DiLoCo H=50, dense", dict(compressor="identity", diloco_every=50)),
    ("DiLoCo H=50, int8 blocks 4-bit", dict(compressor="int8_block", bits=4,
                                             diloco_every=50)),
]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--out", default=None, help="also write the table here")
  args = ap.parse_args(argv)
  xla_flags.set_cpu_devices(8)
  from examples.char_lm import train  # pylint: disable=g-import-not-at-top

  rows, base = [], None
  for label, fields in RUNS:
    t0 = time.perf_counter()
    r = train.train_and_evaluate(train.Config(progress=False, **fields))
    loss, total = r["epochs"][-1]["valid_loss"], r["bytes_per_step"] * r["steps"]
    base = base or (loss, r["dense_bytes_per_step"] * r["steps"])
    rows.append((label, f"{loss:.4f}", f"{100 * (loss / base[0] - 1):+.2f}%",
                 f"{total:,.0f}", f"{base[1] / total:,.1f}x"))
    print(f"{label}: {time.perf_counter() - t0:.0f} s ({r['steps']} steps)",
          flush=True)
  hdr = ("run", "validation loss", "vs dense", "bytes / device over the run",
         "fewer than dense")
  text = "\n".join(["| " + " | ".join(hdr) + " |", "|" + " --- |" * len(hdr)]
                   + ["| " + " | ".join(r) + " |" for r in rows])
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(f"$ python benchmarks/diloco_char_lm.py "
              f"{' '.join(argv or sys.argv[1:])}\n\n{text}\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
