"""The islands' JSON-lines logs (``examples/elastic/island.py --log``), as
the elastic benchmarks read them."""

from __future__ import annotations

import json
import os
import time


def events(path):
  """The complete lines of ``path`` so far, parsed (none if it is absent)."""
  if not os.path.exists(path):
    return []
  with open(path) as f:
    return [json.loads(line) for line in f if line.endswith("\n")]


def wait(pred, timeout, what):
  """``pred()``'s first truthy value, polled every 50 ms.

  Raises:
    RuntimeError: none within ``timeout`` seconds, naming ``what``.
  """
  t0 = time.monotonic()
  while time.monotonic() - t0 < timeout:
    got = pred()
    if got:
      return got
    time.sleep(0.05)
  raise RuntimeError(f"timed out waiting for {what}")
