"""jaxcomp: gradient compression inside JAX data-parallel collectives.

The public API: :func:`compressed_mean` (an Optax transform), the helpers
that run it under ``jax.shard_map`` (:func:`per_device_grad`,
:func:`init_sharded`, :func:`make_train_step`), the ``jax.jit`` idiom
(:func:`compressed_value_and_grad`), low-communication training
(:func:`diloco`, :func:`demo`), and :func:`collective_traffic` to read what
a compiled step sends. The subpackages hold the rest, by task:
:mod:`jaxcomp.compressors`, :mod:`jaxcomp.collectives`,
:mod:`jaxcomp.feedback`, :mod:`jaxcomp.bucketing` (the parts of a
compressed exchange), :mod:`jaxcomp.steps`, :mod:`jaxcomp.placement` and
:mod:`jaxcomp.jit` (the step, its layouts and the state's placement),
:mod:`jaxcomp.fsdp`, :mod:`jaxcomp.lowcomm`, :mod:`jaxcomp.flax`,
:mod:`jaxcomp.checkpoint` and :mod:`jaxcomp.distributed` (multi-host),
:mod:`jaxcomp.perfmodel` and :mod:`jaxcomp.kernels` (the Pallas kernels
and their autotuner). ``jaxcomp.__all__`` lists this module's names by
task, in the order the API reference documents them.
"""

from jaxcomp import bucketing
from jaxcomp import checkpoint
from jaxcomp import collectives
from jaxcomp import combinators
from jaxcomp import compressors
from jaxcomp import distributed
from jaxcomp import feedback
from jaxcomp import fsdp
from jaxcomp import jit
from jaxcomp import lowcomm
from jaxcomp import placement
from jaxcomp import sharding
from jaxcomp import steps
from jaxcomp import wire

# The transform and its state.
from jaxcomp.transform import CompressedMeanState
from jaxcomp.transform import CompressionStats
from jaxcomp.transform import ExchangeStats
from jaxcomp.transform import compressed_mean
from jaxcomp.transform import get_stats
from jaxcomp.transform import transform_configs

# Combinators around it.
from jaxcomp.combinators import apply_if_finite
from jaxcomp.combinators import multi_steps
from jaxcomp.compressors import sparsity_warmup

# Placement and the train step.
from jaxcomp.placement import PlacementError
from jaxcomp.placement import init_sharded
from jaxcomp.placement import per_device_grad
from jaxcomp.placement import per_device_value_and_grad
from jaxcomp.placement import state_partition_specs
from jaxcomp.placement import to_global
from jaxcomp.placement import to_local
from jaxcomp._mesh import to_varying
from jaxcomp._mesh import varying_axes
from jaxcomp.steps import make_train_step
from jaxcomp.steps import shard_train_step

# The jax.jit idiom.
from jaxcomp.jit import CompressedValueAndGrad
from jaxcomp.jit import compressed_value_and_grad

# Low-communication training.
from jaxcomp.lowcomm import demo
from jaxcomp.lowcomm import diloco

# Reading a compiled step.
from jaxcomp.inspect.traffic import CollectiveOp
from jaxcomp.inspect.traffic import Traffic
from jaxcomp.inspect.traffic import collective_traffic

__version__ = "0.1.0"

__all__ = [
    # The transform and its state.
    "compressed_mean", "CompressedMeanState", "CompressionStats", "ExchangeStats",
    "get_stats", "transform_configs",
    # Combinators around it.
    "apply_if_finite", "multi_steps", "sparsity_warmup",
    # Placement and the train step.
    "init_sharded", "make_train_step", "shard_train_step", "per_device_grad",
    "per_device_value_and_grad", "state_partition_specs", "to_global",
    "to_local", "to_varying", "varying_axes", "PlacementError",
    # The jax.jit idiom.
    "compressed_value_and_grad", "CompressedValueAndGrad",
    # Low-communication training.
    "diloco", "demo",
    # Reading a compiled step.
    "collective_traffic", "Traffic", "CollectiveOp",
]
