"""Preemption: whether to checkpoint and stop now, the same answer on every
process (:func:`preemption_requested`)."""

from __future__ import annotations

import jax

_TERM_SIGNALS: list[int] = []


def _note_sigterm(signum, frame):
  del frame
  _TERM_SIGNALS.append(signum)


def preemption_requested(step: int) -> bool:
  """Whether to checkpoint and stop now, the same answer on every process.

  A scheduler preempts a job with SIGTERM (to one process, or to the
  launcher, which forwards it). In a multi-process job JAX catches SIGTERM
  in every process and agrees, in the background, on the step at which all
  of them stop (``jax.experimental.multihost_utils.
  reached_preemption_sync_point``): this returns True on every process at
  that same step. In a single-process run it returns True once the process
  got SIGTERM (the first call installs the handler).

  Call it at every step, with the step about to run (every process from the
  same step), save a checkpoint when it returns True and exit 0; resuming
  from that checkpoint is bit-exact (``examples/multihost/train_mlp.py``).

  Args:
    step: the step number, increasing by one per call.

  Returns:
    True when the job must stop at this step.
  """
  if jax.distributed.is_initialized():
    from jax.experimental import multihost_utils  # pylint: disable=g-import-not-at-top
    return bool(multihost_utils.reached_preemption_sync_point(int(step)))
  import signal  # pylint: disable=g-import-not-at-top
  import threading  # pylint: disable=g-import-not-at-top
  if (signal.getsignal(signal.SIGTERM) is not _note_sigterm
      and threading.current_thread() is threading.main_thread()):
    signal.signal(signal.SIGTERM, _note_sigterm)
  return bool(_TERM_SIGNALS)
