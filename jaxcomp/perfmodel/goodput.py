"""Goodput of DiLoCo islands under failures: elastic islands
(:mod:`jaxcomp.elastic`, the others go on) against one job that restarts.

Goodput is island-intervals committed over island-intervals run (the
measure of ``benchmarks/elastic_char_lm.py``). An island fails at a
uniformly random moment of an outer interval of ``interval_seconds`` (``H``
inner steps and the exchange). Per failure:

* elastic (torchft's quorum, Decoupled DiLoCo): the ``N - 1`` survivors
  discard the interrupted interval and wait up to the heartbeat timeout
  before the next quorum, ``(N - 1) (I + T)`` island-seconds; the failed
  island loses its interval, is down ``R`` seconds, and rejoins at the
  next sync boundary (half an interval on average), ``I + R + I / 2``;
* one job (a lost process ends the run, which restarts from the last
  sync's checkpoint): all ``N`` islands lose the work since the last sync
  (half an interval on average) and are down ``R``: ``N (I / 2 + R)``.

Goodput is one minus the island-seconds lost per hour over the
island-seconds of an hour, ``N * 3600``, at ``failures_per_hour`` failures
per island. First-order: failures do not overlap, and an exchange that
fails does so at once (a SIGKILL closes the island's sockets; a partition
is found at the heartbeat timeout, counted for the survivors).
References: Douillard et al., *Streaming DiLoCo* (2025) and Liu et al.,
*Decoupled DiLoCo* (goodput under failures); torchft's Lighthouse quorum.
"""

from __future__ import annotations


def island_seconds_lost(islands: int, interval_seconds: float,
                        restart_seconds: float, *,
                        heartbeat_timeout: float = 0.0,
                        elastic: bool = True) -> float:
  """Island-seconds lost to one island's failure (see the module).

  Args:
    islands: ``N``, islands in the run (an integer >= 2 for ``elastic``).
    interval_seconds: ``I``, one outer interval (``H`` inner steps plus the
      exchange), seconds.
    restart_seconds: ``R``, from the failure until the island (elastic) or
      the job (not) runs again, seconds.
    heartbeat_timeout: ``T``, seconds the survivors wait before the next
      quorum drops the failed island (elastic only).
    elastic: islands that go on (``True``) or one job that restarts.

  Returns:
    Island-seconds lost, a float.

  Raises:
    ValueError: a count or time out of range, naming it.

  Example:
    >>> from jaxcomp import perfmodel
    >>> round(perfmodel.island_seconds_lost(3, 2.9, 58.0) / 2.9, 1)  # intervals
    23.5
  """
  _check(islands, interval_seconds, restart_seconds, heartbeat_timeout,
         elastic)
  n, i, r = islands, interval_seconds, restart_seconds
  if elastic:
    return (n - 1) * (i + heartbeat_timeout) + i + r + i / 2
  return n * (i / 2 + r)


def goodput(islands: int, interval_seconds: float, failures_per_hour: float,
            restart_seconds: float, *, heartbeat_timeout: float = 0.0,
            elastic: bool = True) -> float:
  """Expected goodput at ``failures_per_hour`` failures per island.

  Args:
    islands: ``N``, as in :func:`island_seconds_lost`.
    interval_seconds: ``I``, one outer interval, seconds.
    failures_per_hour: failures per island per hour, >= 0.
    restart_seconds: ``R``, seconds until the island (or job) runs again.
    heartbeat_timeout: ``T``, seconds the survivors wait (elastic only).
    elastic: islands that go on (``True``) or one job that restarts.

  Returns:
    The fraction of island-intervals committed, in ``[0, 1]`` (0 where
    failures come faster than the run recovers).

  Raises:
    ValueError: a count or time out of range, naming it.

  Example:
    >>> from jaxcomp import perfmodel
    >>> # 8 islands, H = 500 steps of 1 s, a failure per island a day,
    >>> # 30 minutes to restart (a preempted pool), 10 s heartbeat timeout:
    >>> kw = dict(restart_seconds=1800.0, heartbeat_timeout=10.0)
    >>> round(perfmodel.goodput(8, 500.0, 1 / 24, **kw), 3)
    0.929
    >>> round(perfmodel.goodput(8, 500.0, 1 / 24, elastic=False, **kw), 3)
    0.81
  """
  if not failures_per_hour >= 0:
    raise ValueError(f"failures_per_hour must be >= 0, got {failures_per_hour!r}")
  lost = island_seconds_lost(islands, interval_seconds, restart_seconds,
                             heartbeat_timeout=heartbeat_timeout,
                             elastic=elastic)
  return max(0.0, 1.0 - failures_per_hour * lost / 3600.0)


def _check(islands, interval_seconds, restart_seconds, heartbeat_timeout,
           elastic) -> None:
  if isinstance(islands, bool) or not isinstance(islands, int) or islands < 1:
    raise ValueError(f"islands must be an integer >= 1, got {islands!r}")
  if elastic and islands < 2:
    raise ValueError("islands must be >= 2 for elastic islands (one island "
                     "has no other to go on): pass elastic=False")
  if not interval_seconds > 0:
    raise ValueError(f"interval_seconds must be > 0, got {interval_seconds!r}")
  for name, v in (("restart_seconds", restart_seconds),
                  ("heartbeat_timeout", heartbeat_timeout)):
    if not v >= 0:
      raise ValueError(f"{name} must be seconds >= 0, got {v!r}")
