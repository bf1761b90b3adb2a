"""MG-WFBP: merge consecutive layers' gradients into buckets when it pays.

Shi, Chu & Li, *MG-WFBP: Efficient Data Communication for Distributed
Synchronous SGD Algorithms* <https://arxiv.org/abs/1811.11141>, INFOCOM 2019
(extended as *MG-WFBP: Merging Gradients Wisely for Efficient Communication in
Distributed Deep Learning*, TPDS 2021).

Under wait-free backpropagation each bucket's all-reduce starts at
``max(previous bucket's all-reduce has finished, the bucket's last gradient
exists)`` and costs ``t_c(m) = alpha + beta·m``. Walking from the output layer
towards the input, layer ``l`` is merged into layer ``l-1``'s message when
layer ``l-1``'s gradient is ready before layer ``l``'s communication would
finish, and either layer ``l``'s communication could not start before then
anyway, or the wait it adds is shorter than the start-up cost saved (``alpha``).
The paper proves the resulting plan optimal under its assumptions. Checked
here by brute force on random small cases (tests/test_perfmodel.py): the plan
is never slower than per-layer or single-bucket, but it is a greedy walk and
is not always the best of all partitions.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

__all__ = ["mgwfbp_plan", "wfbp_finish_time"]


def _comm_starts(tc: list[float], tb: Sequence[float], taob: list[float]) -> list[float]:
  L = len(tb)
  taoc = [0.0] * L
  taoc[L - 1] = taob[L - 1] + tb[L - 1]
  for l in range(L - 2, -1, -1):
    taoc[l] = max(taoc[l + 1] + tc[l + 1], taob[l] + tb[l])
  return taoc


def _check(layer_bytes, backward_times):
  if len(layer_bytes) != len(backward_times):
    raise ValueError(f"layer_bytes and backward_times differ in length: "
                     f"{len(layer_bytes)} != {len(backward_times)}")
  if not layer_bytes:
    raise ValueError("need at least one layer")
  if any(b < 0 for b in layer_bytes) or any(t < 0 for t in backward_times):
    raise ValueError("layer_bytes and backward_times must be >= 0")


def mgwfbp_plan(layer_bytes: Sequence[float], backward_times: Sequence[float],
                alpha: float, beta: float, *,
                comm_time: Callable[[float], float] | None = None) -> list[list[int]]:
  """The MG-WFBP bucket plan.

  Args:
    layer_bytes: gradient bytes of each layer, forward order (index 0 is the
      input layer, whose gradient is computed last).
    backward_times: backward seconds of each layer, same order.
    alpha: start-up seconds of one all-reduce message (>= 0).
    beta: seconds per byte of one all-reduce (>= 0); for a ring on ``p``
      workers that is ``2(p-1)/p`` times the link's seconds/byte.
    comm_time: optional ``bytes -> seconds`` replacing ``alpha + beta·bytes``
      (e.g. a compressor's payload through the full collective model); the
      start-up cost saved by a merge is then ``t(a) + t(b) - t(a+b)``.

  Returns:
    Buckets in communication order (the bucket holding the output layer
    first), each a list of consecutive layer indices in increasing order.

  Example:
    >>> mgwfbp_plan([4, 4, 4], [1e-3, 1e-3, 1e-3], alpha=1.0, beta=0.0)
    [[0, 1, 2]]
  """
  _check(layer_bytes, backward_times)
  if alpha < 0 or beta < 0:
    raise ValueError(f"alpha and beta must be >= 0, got {alpha=}, {beta=}")
  cost = comm_time if comm_time is not None else (lambda m: alpha + beta * m)
  L = len(layer_bytes)
  tb = [float(t) for t in backward_times]
  p = [float(b) for b in layer_bytes]
  tc = [cost(m) for m in p]
  taob = [0.0] * L
  for l in range(L - 2, -1, -1):
    taob[l] = taob[l + 1] + tb[l + 1]
  taoc = _comm_starts(tc, tb, taob)

  buckets, group = [], []
  for l in range(L - 1, 0, -1):
    group.append(l)
    ready_prev = taob[l - 1] + tb[l - 1]  # when layer l-1's gradient exists
    merge = False
    if ready_prev < taoc[l] + tc[l]:
      if taoc[l] > ready_prev:
        merge = True
      else:
        saved = tc[l] + tc[l - 1] - cost(p[l - 1] + p[l])
        merge = ready_prev - taoc[l] < saved
    if merge:
      p[l - 1] += p[l]
      p[l] = 0.0
      tc[l] = 0.0
      tc[l - 1] = cost(p[l - 1])
      taoc = _comm_starts(tc, tb, taob)
    else:
      buckets.append(sorted(group))
      group = []
  group.append(0)
  buckets.append(sorted(group))
  return buckets


def wfbp_finish_time(buckets: Sequence[Sequence[int]], layer_bytes: Sequence[float],
                     backward_times: Sequence[float], alpha: float, beta: float, *,
                     comm_time: Callable[[float], float] | None = None) -> float:
  """When the last bucket's communication ends, backward starting at 0 (seconds).

  The MG-WFBP objective; :func:`jaxcomp.perfmodel.predict` gives the full step.
  """
  _check(layer_bytes, backward_times)
  cost = comm_time if comm_time is not None else (lambda m: alpha + beta * m)
  t = net = 0.0
  for b in buckets:
    t += sum(backward_times[i] for i in b)
    net = max(net, t) + cost(sum(layer_bytes[i] for i in b))
  return max(net, t)
