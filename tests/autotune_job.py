"""One process of the 2-process autotuning test (tests/test_autotune.py).

Each process simulates an NVIDIA GPU whose timer prefers the other path than
its peer's (process 0: the Pallas kernels for QSGD and sign, XLA for int8 and
top-k; process 1 the opposite), and process 1's cache file holds the opposite
of process 0's choices. Each process exports the compressors' encodes for
CUDA with ``implementation=None`` and compares a digest of the programs with
``jaxcomp.distributed.check_agreement``:

* with the agreement (the default), process 0 decides and process 1 takes its
  choices from the job's key-value store, never timing or reading its file:
  the programs agree;
* with ``agree=False`` (each process alone) they differ, which the check
  catches: the test's negative control.

Prints ``RESULT <json>`` lines for the test to read.
"""

import hashlib
import json
import os
import re
import sys

from jaxcomp import distributed

distributed.initialize_from_env()

import jax  # pylint: disable=g-import-not-at-top
import jax.numpy as jnp  # pylint: disable=g-import-not-at-top

import jaxcomp  # pylint: disable=g-import-not-at-top
from jaxcomp import kernels  # pylint: disable=g-import-not-at-top
from jaxcomp.hlo import kernel_structure as structure  # pylint: disable=g-import-not-at-top

OUT = sys.argv[1]
ME = jax.process_index()
PREFER = {0: {"qsgd": "mosaic", "sign": "triton", "int8": "xla", "topk": "xla"},
          1: {"qsgd": "xla", "sign": "xla", "int8": "xla", "topk": "mosaic"}}
CASES = {"qsgd": dict(levels=15, bucket_size=512), "sign": {},
         "int8_block": dict(block_size=256), "topk": dict(ratio=0.01)}
SIZES = (1 << 16, 100_003)
VERSIONS = {"jax": "0.10.2", "jaxlib": "0.10.2", "jaxcomp": "0.1.0"}


class Timer:
  """A fake GPU: the preferred path takes 1 ms, the other 2 ms."""

  def __init__(self, prefer):
    self.prefer, self.calls = prefer, 0

  def __call__(self, key, implementation, fn, args):
    del fn, args
    self.calls += 1
    return 1e-3 if self.prefer.get(key.op, "xla") == implementation else 2e-3


def tuner(agree: bool) -> kernels.Autotuner:
  path = os.path.join(OUT, f"cache.p{ME}.{'agree' if agree else 'alone'}.json")
  return kernels.Autotuner(
      timer=Timer(PREFER[ME]), nvidia=True, interpret=True,
      device_kind="NVIDIA H100 (simulated)", cache_path=path,
      versions=VERSIONS, agree=agree)


def programs(t: kernels.Autotuner) -> str:
  """A digest of every encode's CUDA program under ``t``."""
  jax.clear_caches()  # trace again: decisions are made at trace time
  digest = hashlib.blake2b(digest_size=16)
  with kernels.use_autotuner(t):
    for name in sorted(CASES):
      c = jaxcomp.compressors.get(name, **CASES[name])
      for n in SIZES:
        f = lambda x, k, c=c: c.encode(x, jax.random.wrap_key_data(k))
        text = structure.export_cuda(
            f, jax.ShapeDtypeStruct((n,), jnp.float32),
            jax.ShapeDtypeStruct((2,), jnp.uint32)).mlir_module()
        # Source locations aside (they name the calling line), and a Mosaic
        # GPU kernel's serialized module and its hash (jax >= 0.11 lowers
        # Pallas through Mosaic GPU; the module names its body with a
        # per-process counter such as ``body_10``): the kernel is then told
        # apart by its custom call's target, operands and results (a Triton
        # kernel's serialized IR, ``ir``, likewise).
        text = re.sub(r"^#loc.*$|\sloc\((?:[^()]|\([^()]*\))*\)", "", text,
                      flags=re.M)
        text = re.sub(r'(kernel_hash|module|ir) = "[^"]*"', r"\1", text)
        digest.update(text.encode())
  return digest.hexdigest()


def result(**kw):
  print("RESULT " + json.dumps({"process": ME, **kw}), flush=True)


def main():
  # Process 1's cache file differs from what process 0 will choose (QSGD,
  # sign where Triton is a candidate, top-k; int8 blocks on XLA in both, so
  # that the prefill, which process 0 waits for, exports no kernel).
  if ME == 1:
    pre = tuner(True)
    with kernels.use_autotuner(kernels.Autotuner(
        timer=Timer(PREFER[1]), nvidia=True, interpret=True,
        device_kind=pre.device_kind, cache_path=pre.cache_path,
        versions=VERSIONS, agree=False)):
      programs(kernels.default_autotuner())
  together = tuner(True)
  digest = programs(together)
  distributed.check_agreement([("programs", digest)], what="programs")
  result(mode="agree", digest=digest, timer_calls=together.timer.calls,
         sources=sorted({d.source for d in together.decisions()}),
         choices={str(d.key): d.implementation for d in together.decisions()})
  alone = tuner(False)
  digest = programs(alone)
  try:
    distributed.check_agreement([("programs", digest)], what="programs")
    result(mode="alone", disagreement=None)
  except distributed.AgreementError as e:
    result(mode="alone", disagreement=str(e))


if __name__ == "__main__":
  main()
