"""Sharded data parallelism on the character LM: loss, bytes and memory.

Trains ``examples.char_lm`` (8 simulated CPU devices, the example's default
model and steps) FSDP-style (``--sharding fsdp``: parameters and optimizer
state as flat shards, the gradient reduce-scattered) with a dense float32
reduce-scatter and with compressed ones, the replicated dense run for the
memory comparison, and HSDP-style (``--sharding hsdp``: 2 simulated hosts
of 4 devices, sharded and reduce-scattered exactly inside a host, each
shard averaged across hosts dense or compressed; its bytes are those
across hosts), and prints one row per run: validation loss (and its
relative difference to dense FSDP's), bytes one device hands to the
gradient exchange per step and sends by the ring algorithms, and the
parameter and optimizer-state bytes each device holds.

  python benchmarks/fsdp_char_lm.py --out benchmarks/results/fsdp_char_lm.txt
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from examples import xla_flags  # noqa: E402  (imports no jax)

# (label, sharding, Config fields): dense FSDP first, the baseline.
RUNS = [
    ("identity", "fsdp", dict(compressor="identity")),
    ("int8_block stochastic, no EF", "fsdp",
     dict(compressor="int8_block", rounding="stochastic")),
    ("int8_block 4-bit stochastic, no EF", "fsdp",
     dict(compressor="int8_block", bits=4, rounding="stochastic")),
    ("int8_block nearest + residual EF", "fsdp", dict(compressor="int8_block")),
    ("topk 1% + residual EF", "fsdp", dict(compressor="topk", ratio=0.01)),
    ("identity", "replicated", dict(compressor="identity")),
    # HSDP on 2 hosts x 4 devices: exact inside a host, compressed across
    # (bytes: those across hosts, a shard's).
    ("identity", "hsdp", dict(compressor="identity")),
    ("int8_block stochastic, no EF", "hsdp",
     dict(compressor="int8_block", rounding="stochastic")),
    ("int8_block 4-bit stochastic, no EF", "hsdp",
     dict(compressor="int8_block", bits=4, rounding="stochastic")),
    ("topk 1% + residual EF", "hsdp", dict(compressor="topk", ratio=0.01)),
]


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--steps", type=int, default=None,
                  help="steps per run (default: the example's 3 x 100)")
  ap.add_argument("--out", default=None, help="also write the table here")
  ap.add_argument("--only", nargs="+", choices=("fsdp", "replicated", "hsdp"),
                  help="run only these shardings' rows, and dense FSDP's (the "
                  "baseline of the relative column)")
  args = ap.parse_args(argv)
  xla_flags.set_cpu_devices(8)
  from examples.char_lm import train  # pylint: disable=g-import-not-at-top

  rows, dense_loss = [], None
  for label, sharding, fields in RUNS:
    if args.only and sharding not in args.only and dense_loss is not None:
      continue
    t0 = time.perf_counter()
    r = train.train_and_evaluate(train.Config(
        sharding=sharding, max_steps=args.steps, progress=False, **fields))
    loss = r["epochs"][-1]["valid_loss"]
    if dense_loss is None:
      dense_loss = loss
    rows.append((sharding, label, f"{loss:.4f}",
                 f"{100 * (loss / dense_loss - 1):+.2f}%",
                 f"{r['bytes_per_step']:,.0f}", f"{r['compression']:.2f}x",
                 f"{r['wire_bytes_per_step']:,.0f}",
                 f"{r['param_bytes_per_device']:,}",
                 f"{r['opt_state_bytes_per_device']:,}"))
    print(f"{sharding} {label}: done in {time.perf_counter() - t0:.0f} s "
          f"({r['steps']} steps)", flush=True)
  hdr = ("sharding", "exchange", "validation loss", "vs dense FSDP",
         "bytes / device / step", "compression", "wire bytes / device / step",
         "parameter bytes / device", "optimizer-state bytes / device")
  lines = ["| " + " | ".join(hdr) + " |", "|" + " --- |" * len(hdr)]
  lines += ["| " + " | ".join(r) + " |" for r in rows]
  text = "\n".join(lines)
  print(text)
  if args.out:
    with open(args.out, "w") as f:
      f.write(f"$ python benchmarks/fsdp_char_lm.py {' '.join(argv or sys.argv[1:])}\n\n"
              + text + "\n")
  return 0


if __name__ == "__main__":
  sys.exit(main())
