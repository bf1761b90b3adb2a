"""What the model knows of a model: :class:`ModelProfile`, the gradient
tensors' sizes and the compute times of one model on one device, and its
JSON file (:func:`save_profile`, :func:`load_profile_file`).

Profiles come from :mod:`jaxcomp.perfmodel.profiles` (built in, counted
from the architectures) or :mod:`jaxcomp.perfmodel.profiling` (measured).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any
from collections.abc import Mapping

__all__ = ["ModelProfile", "save_profile", "load_profile_file"]


@dataclasses.dataclass(frozen=True)
class ModelProfile:
  """Gradient sizes and compute times of one model on one device.

  Attributes:
    name: label.
    layer_sizes: elements of each gradient tensor (float32), in forward order
      (index 0 is used first in the forward pass; its gradient is ready last).
    backward_times: seconds of backward pass attributed to each tensor, same
      order. The backward pass runs from the last index to index 0.
    forward_time: seconds of the forward pass (and loss).
    update_time: seconds of the optimizer update after the exchange.
    meta: free-form description (device, batch, how it was measured).
  """

  name: str
  layer_sizes: tuple[int, ...]
  backward_times: tuple[float, ...]
  forward_time: float
  update_time: float = 0.0
  meta: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  def __post_init__(self):
    object.__setattr__(self, "layer_sizes", tuple(int(n) for n in self.layer_sizes))
    object.__setattr__(self, "backward_times", tuple(float(t) for t in self.backward_times))
    if not self.layer_sizes:
      raise ValueError("a profile needs at least one layer")
    if len(self.layer_sizes) != len(self.backward_times):
      raise ValueError(
          f"layer_sizes and backward_times differ in length: "
          f"{len(self.layer_sizes)} != {len(self.backward_times)}")
    if any(n < 0 for n in self.layer_sizes):
      raise ValueError("layer_sizes must be >= 0 elements")
    if any(not (t >= 0 and math.isfinite(t)) for t in self.backward_times):
      raise ValueError("backward_times must be finite seconds >= 0")
    if not (self.forward_time >= 0 and self.update_time >= 0):
      raise ValueError(f"forward_time and update_time must be >= 0, got "
                       f"{self.forward_time=}, {self.update_time=}")

  @property
  def num_params(self) -> int:
    return sum(self.layer_sizes)

  @property
  def backward_time(self) -> float:
    return sum(self.backward_times)

  @property
  def compute_time(self) -> float:
    """One worker's step without communication (forward + backward + update), seconds."""
    return self.forward_time + self.backward_time + self.update_time

  def scaled(self, factor: float) -> ModelProfile:
    """The same model on a device ``factor`` times slower (times multiplied)."""
    return dataclasses.replace(
        self,
        backward_times=tuple(t * factor for t in self.backward_times),
        forward_time=self.forward_time * factor,
        update_time=self.update_time * factor)

  def tensor_parallel(self, degree: int) -> ModelProfile:
    """The model as each device of a tensor-parallel group of ``degree``
    devices holds it (Megatron-LM's layout, the ``tensor`` axis of
    MaxText's ``(data, fsdp, tensor)`` mesh): every gradient tensor split
    ``degree`` ways (``ceil(n / degree)`` elements per device) and the
    compute times divided by ``degree``. The data-parallel exchange
    (replicated, ``"shard"``, ``"hsdp"``) then prices one device's shard of
    every tensor, as :func:`jaxcomp.compressed_value_and_grad` compresses it.

    The tensor axis's own collectives (the activations' all-reduces inside
    the forward and backward passes, the same with and without
    compression) are not priced: the real step is longer by them, so the
    share of the step that compression can save is smaller than predicted
    (an upper bound on its speedup). Tensors that are replicated over the
    tensor axis (norm scales, biases) are split too.

    Args:
      degree: devices in the tensor-parallel group, an integer >= 1.

    Raises:
      ValueError: ``degree`` is not an integer >= 1.

    Example:
      >>> from jaxcomp import perfmodel
      >>> p = perfmodel.ModelProfile("mlp", (1000, 10), (2e-3, 1e-4), 1e-3)
      >>> tp = p.tensor_parallel(4)
      >>> tp.layer_sizes, round(tp.compute_time * 1e3, 3)
      ((250, 3), 0.775)
    """
    if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
      raise ValueError(f"degree (tensor parallelism) must be an integer >= 1, "
                       f"got {degree!r}")
    if degree == 1:
      return self
    return dataclasses.replace(
        self, name=f"{self.name} / tensor {degree}",
        layer_sizes=tuple(-(-n // degree) for n in self.layer_sizes),
        backward_times=tuple(t / degree for t in self.backward_times),
        forward_time=self.forward_time / degree,
        update_time=self.update_time / degree,
        meta={**self.meta, "tensor_parallel": degree})

  def to_dict(self) -> dict:
    return {
        "name": self.name,
        "layer_sizes": list(self.layer_sizes),
        "backward_times": list(self.backward_times),
        "forward_time": self.forward_time,
        "update_time": self.update_time,
        "meta": dict(self.meta),
    }

  @classmethod
  def from_dict(cls, d: Mapping[str, Any]) -> ModelProfile:
    missing = {"name", "layer_sizes", "backward_times", "forward_time"} - set(d)
    if missing:
      raise ValueError(f"profile is missing fields {sorted(missing)}")
    return cls(name=d["name"], layer_sizes=d["layer_sizes"],
               backward_times=d["backward_times"], forward_time=d["forward_time"],
               update_time=d.get("update_time", 0.0), meta=d.get("meta", {}))


def save_profile(profile: ModelProfile, path: str | os.PathLike) -> None:
  """Writes ``profile`` as JSON (read back by :func:`load_profile_file`)."""
  with open(path, "w") as f:
    json.dump(profile.to_dict(), f, indent=1)


def load_profile_file(path: str | os.PathLike) -> ModelProfile:
  """Reads a profile written by :func:`save_profile`.

  Raises:
    FileNotFoundError: no such file.
    ValueError: the file is not a profile.
  """
  if not os.path.isfile(path):
    raise FileNotFoundError(f"profile file {os.fspath(path)!r} does not exist")
  with open(path) as f:
    try:
      d = json.load(f)
    except json.JSONDecodeError as e:
      raise ValueError(f"profile file {os.fspath(path)!r} is not JSON: {e}") from None
  if not isinstance(d, dict):
    raise ValueError(f"profile file {os.fspath(path)!r} does not hold a JSON object")
  return ModelProfile.from_dict(d)
