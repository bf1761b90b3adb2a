"""A transform's configuration: validated and resolved at construction
(:class:`MeanSpec`, what :func:`jaxcomp.compressed_mean`'s ``init`` and
``update`` read), and carried in its own state (:class:`TransformConfig`).

Every :func:`jaxcomp.compressed_mean` state holds a :class:`TransformConfig`
as *static* pytree data: no array, nothing to save or restore, part of the
state's tree structure. Whoever holds the state (a checkpoint, the
multi-process agreement check, :func:`transform_configs`, FSDP's checks)
reads the configuration from it, in any process, including one that
restored the state from a checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
import numbers
from typing import Any
from collections.abc import Mapping, Sequence

import jax
import jax.core
import numpy as np

from jaxcomp import _mesh
from jaxcomp import bucketing as bucketing_lib
from jaxcomp import collectives as collectives_lib
from jaxcomp import compressors as compressors_lib
from jaxcomp import feedback as feedback_lib
from jaxcomp._mesh import AxisName
from jaxcomp.transform import _nonfinite as nonfinite_lib
from jaxcomp.transform._exchange import Components
from jaxcomp.transform._buckets import Bucketing

OUTPUTS = ("mean", "shard")

# How a per-device state field moves to a mesh of another size (see
# jaxcomp.checkpoint.topology_rules): "average", "rechunk", or
# "refuse: <why>".
TopologyRule = str


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True, eq=False)
class TransformConfig:
  """The configuration of one transform, as static pytree data.

  It annotates the state and takes no part in the identity of its tree
  structure: any two compare equal (and hash alike), so that states of two
  transforms whose arrays are alike are interchangeable, as a warm-up's
  stages pass one state from transform to transform, and a step compiled
  for one takes the other. Each transform's ``update`` writes its own
  configuration into the state it returns. Compare configurations with
  :meth:`as_dict`.

  Attributes:
    text: the configuration as JSON with sorted keys (compressor and its
      hyperparameters, collective, error feedback, bucketing, nonfinite
      policy, seed, axis names, output); a scheduled hyperparameter reads
      ``"scheduled"``.
    rules: ``((state field, rule), ...)``: how each per-device field of the
      state moves to a mesh of another size, as the part that keeps it
      declares (``Feedback.topology``, ``Collective.topology``).
    plan: the bucket plan ``init`` made, where the bucketing depends on
      where ``init`` ran (``"auto"``), else None.
    every: the exchange's cadence, steps per exchange: 1 for a mean taken
      every step; :func:`jaxcomp.diloco`'s ``sync_every`` for its
      pseudo-gradients' (set by :func:`jaxcomp.transform.with_cadence`,
      read by :func:`jaxcomp.get_stats`); not part of the description.
    micro_steps: calls of the train step per step of the transform: a
      :func:`jaxcomp.multi_steps`' ``every_k`` around it (set by
      :func:`jaxcomp.transform.in_micro_steps`), else 1. The exchange runs
      once per ``every * micro_steps`` calls.
  """

  text: str
  rules: tuple[tuple[str, TopologyRule], ...] = ()
  # The bucket plan ``init`` made (``bucketing="auto"``, whose plan depends
  # on the leaves' types where ``init`` ran: a tensor-parallel shard is kept
  # apart), so that every ``update`` of the state cuts the gradient alike,
  # wherever it is traced; not part of the configuration's description.
  plan: Any = None
  every: int = 1
  micro_steps: int = 1

  @classmethod
  def of(cls, config: Mapping[str, Any],
         rules: Mapping[str, TopologyRule] | None = None) -> TransformConfig:
    """From a description (values made JSON-able by :func:`describe`)."""
    described = {k: describe(v) for k, v in config.items()}
    return cls(json.dumps(described, sort_keys=True),
               tuple(sorted((rules or {}).items())))

  def __eq__(self, other) -> bool:
    return isinstance(other, TransformConfig)

  def __hash__(self) -> int:
    return hash(TransformConfig)

  def as_dict(self) -> dict[str, Any]:
    """The configuration as a dict."""
    return json.loads(self.text)

  @property
  def topology(self) -> dict[str, TopologyRule]:
    """``{state field: rule}`` of the per-device state fields."""
    return dict(self.rules)


def describe(value):
  """A JSON-able description of a configuration value: dataclasses (the
  compressor, collective, feedback) by their name and init fields, a
  scheduled (traced) hyperparameter as ``"scheduled"``."""
  if isinstance(value, jax.core.Tracer):
    return "scheduled"
  if dataclasses.is_dataclass(value) and not isinstance(value, type):
    return {"name": getattr(value, "name", type(value).__name__),
            **{f.name: describe(getattr(value, f.name))
               for f in dataclasses.fields(value) if f.init}}
  if isinstance(value, (list, tuple)):
    return [describe(v) for v in value]
  if isinstance(value, (str, int, float, bool)) or value is None:
    return value
  if isinstance(value, (jax.Array, np.ndarray)) and np.ndim(value) == 0:
    return np.asarray(value).item()
  return repr(value)


def find_configs(state, state_type) -> dict[str, TransformConfig]:
  """``{path: TransformConfig}`` of every ``state_type`` (a NamedTuple with
  a ``config`` field) in ``state``, by its path (``jax.tree_util.keystr``)."""
  found = {}

  def visit(path, x):
    if isinstance(x, state_type):
      found[jax.tree_util.keystr(path)] = x.config

  jax.tree_util.tree_map_with_path(
      visit, state, is_leaf=lambda x: isinstance(x, state_type))
  return found


@dataclasses.dataclass(frozen=True, eq=False)
class MeanSpec:
  """One :func:`jaxcomp.compressed_mean`, its arguments validated and
  resolved (static): what its ``init`` and ``update`` read. Built once, by
  :func:`resolve`, when the transform is constructed.

  Attributes:
    components: the compressor, collective, feedback and nonfinite policy.
    axis_name: the averaging axes.
    buckets: the bucketing arguments, the strategy resolved (``"auto"``
      reads ``"layerwise"`` where that is what it means: a compressor bound
      to one tensor's shape, or a plain psum of every leaf).
    seed: the seed of the key shared by all devices.
    shard: ``output="shard"``: each device gets its shard of the mean.
    config: the configuration the state carries (before ``init`` made a
      plan, see :attr:`plans_at_init`).
    facts: what a bucket plan fixes (the state's shapes and the statistics'
      static fields), by the bucket plan it was found for: each is found once,
      by ``init`` or by the first ``update`` traced for that bucket plan, and
      reused by every later trace.
    arguments: :func:`resolve`'s arguments, as given: the same transform
      over other axes is resolved from them
      (:func:`jaxcomp.transform.over_axes`).
  """

  components: Components
  axis_name: AxisName
  buckets: Bucketing
  seed: int
  shard: bool
  config: TransformConfig
  facts: dict = dataclasses.field(default_factory=dict, repr=False)
  arguments: dict = dataclasses.field(default_factory=dict, repr=False)

  @property
  def plans_at_init(self) -> bool:
    """Whether the bucket plan depends on where ``init`` ran
    (``bucketing="auto"`` without a plan), so the state carries it."""
    return self.buckets.strategy == "auto" and self.buckets.plan is None


def _check_output(output, comp, coll, fb) -> None:
  """Construction-time checks of ``compressed_mean(output=...)``."""
  if output not in OUTPUTS:
    raise ValueError(f"output must be one of {OUTPUTS}, got {output!r}")
  if output == "mean":
    return
  if comp.own_exchange:
    raise ValueError(
        f"output='shard' cannot use compressor {comp.name!r}: it runs its own "
        "exchange of whole tensors; use a quantizer or a sparsifier (e.g. "
        "'int8_block', 'qsgd', 'topk')")
  if not coll.reduce_scatter:
    raise ValueError(
        f"output='shard' needs a collective with a reduce-scatter; "
        f"collective={coll.name!r} has none: leave collective=None")
  if fb.keeps_mean:
    raise ValueError(
        f"output='shard' cannot use error_feedback={fb.name!r}: it keeps the "
        "whole mean on every device; use 'residual', 'dgc' or False")


def _check_integers(min_compress_size: int, seed: int) -> None:
  """``min_compress_size`` and ``seed`` are integers in range."""
  if (isinstance(min_compress_size, bool)
      or not isinstance(min_compress_size, numbers.Integral)
      or min_compress_size < 0):
    raise ValueError("min_compress_size must be an integer >= 0, got "
                     f"{min_compress_size=!r}")
  # jax.random.key takes a seed that fits int64; found later, in init, an
  # OverflowError would name nothing.
  if (isinstance(seed, bool) or not isinstance(seed, numbers.Integral)
      or not -2**63 <= seed < 2**63):
    raise ValueError(f"seed must be an integer in [-2**63, 2**63), got "
                     f"{seed=!r}")


def _policy(nonfinite, unprotected: bool, comp, coll, fb):
  """``(name, policy)`` of ``nonfinite`` (``None``: the default)."""
  if nonfinite is None:
    nonfinite = "none" if unprotected else "skip"
  policy = nonfinite_lib.get(nonfinite)
  if nonfinite == "none" and not unprotected:
    raise ValueError(
        "nonfinite='none' leaves no check, which only a transform without "
        "per-device state that sends every coordinate can afford (identity "
        f"or a cast over 'psum'); {comp.name!r} with collective "
        f"{coll.name!r} and error_feedback {fb.name!r} would let a NaN into "
        "its state or drop it from the mean: use 'skip', 'zero' or "
        "'propagate'")
  return nonfinite, policy


def _strategy(bucketing: str, comp, unprotected: bool, plan,
              bucket_bytes) -> str:
  """The bucketing strategy, ``"auto"`` resolved where it means one bucket
  per leaf."""
  if comp.per_tensor and plan is None and bucketing == "auto":
    if bucket_bytes is not None:
      raise ValueError(
          f"compressor {comp.name!r} works on one tensor at a time, so "
          f"bucketing='auto' keeps one bucket per leaf and would ignore "
          f"{bucket_bytes=}: drop bucket_bytes")
    bucketing = "layerwise"  # what "auto" means for it
  if unprotected and plan is None and bucketing == "auto" and (
      bucket_bytes is None):
    # A plain psum of every leaf: XLA's all-reduce combiner already merges
    # a step's independent all-reduces, so packing would only add a copy
    # (compression switched off compiles to the plain step).
    bucketing = "layerwise"
  if comp.per_tensor and (plan is not None or bucketing != "layerwise"):
    raise ValueError(
        f"compressor {comp.name!r} works on one tensor at a time, in its "
        f"shape: use bucketing='layerwise' or 'auto' (the default) and no "
        f"plan, not bucketing={bucketing!r}"
        + ("" if plan is None else " with a plan"))
  return bucketing


def resolve(compressor, axis_name: AxisName, *, collective, error_feedback,
            bucketing: str, min_compress_size: int,
            bucket_elements: int | None, bucket_bytes: int | None,
            plan: Sequence[Sequence[int]] | None, mask, nonfinite: str | None,
            seed: int, output: str, compressor_kwargs: Mapping[str, Any]
            ) -> MeanSpec:
  """:func:`jaxcomp.compressed_mean`'s arguments, checked and resolved.

  Raises:
    ValueError: what :func:`jaxcomp.compressed_mean` lists as refused at
      construction.
  """
  arguments = dict(
      compressor=compressor, axis_name=axis_name, collective=collective,
      error_feedback=error_feedback, bucketing=bucketing,
      min_compress_size=min_compress_size, bucket_elements=bucket_elements,
      bucket_bytes=bucket_bytes, plan=plan, mask=mask, nonfinite=nonfinite,
      seed=seed, output=output, compressor_kwargs=dict(compressor_kwargs))
  _mesh.check_axis_name(axis_name)
  comp = compressors_lib.get(compressor, **compressor_kwargs)
  coll = collectives_lib.get(collective, comp, axis_name=axis_name)
  fb = feedback_lib.get(error_feedback, comp.biased)
  # Stateless and dense: nothing to protect, and a NaN reaches the mean.
  unprotected = (comp.dense and isinstance(fb, feedback_lib.NoFeedback)
                 and isinstance(coll, collectives_lib.PsumMean))
  nonfinite, policy = _policy(nonfinite, unprotected, comp, coll, fb)
  _check_integers(min_compress_size, seed)
  _check_output(output, comp, coll, fb)
  bucketing_lib.check_config(bucketing, bucket_elements=bucket_elements,
                             bucket_bytes=bucket_bytes, plan=plan)
  bucketing = _strategy(bucketing, comp, unprotected, plan, bucket_bytes)
  config = TransformConfig.of({
      "compressor": comp, "collective": coll, "error_feedback": fb,
      "axis_name": axis_name, "bucketing": bucketing,
      "min_compress_size": min_compress_size,
      "bucket_elements": bucket_elements, "bucket_bytes": bucket_bytes,
      "plan": plan, "mask": None if mask is None else "given",
      "nonfinite": nonfinite, "seed": seed, "output": output},
      rules={"feedback": fb.topology, "exchange_state": coll.topology})
  return MeanSpec(
      components=Components(comp, coll, fb, policy), axis_name=axis_name,
      buckets=Bucketing(bucketing, min_compress_size, bucket_elements,
                        bucket_bytes, plan, mask),
      seed=seed, shard=output == "shard", config=config, arguments=arguments)
