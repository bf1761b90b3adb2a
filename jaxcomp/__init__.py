"""jaxcomp: gradient compression inside JAX data-parallel collectives.

The public API, one door per task:

* the transform: :func:`compressed_mean` (an Optax gradient
  transformation), its state and :func:`get_stats`; the combinators
  around it;
* a ``jax.shard_map`` train step for every layout: :func:`jaxcomp.init` and
  :func:`jaxcomp.make_train_step`, passing a :class:`jaxcomp.TrainState`; the layouts
  :class:`DataParallel`, :class:`FSDP` and :class:`Islands`
  (:mod:`jaxcomp.layouts`); :func:`per_device_value_and_grad` and
  :func:`per_device_grad`, the building blocks of a hand-written
  per-device step (:mod:`jaxcomp.placement` and :mod:`jaxcomp.steps` hold
  the rest of the plumbing);
* a ``jax.jit`` (GSPMD) step: :func:`compressed_value_and_grad`;
* low-communication training: :func:`diloco`, :func:`demo`;
* compressed optimizers (DeepSpeed's): :func:`onebit_adam`,
  :func:`zero_one_adam`, :func:`onebit_lamb`;
* what a compiled step sends: :func:`collective_traffic`.

The subpackages hold the rest, by task: :mod:`jaxcomp.compressors`,
:mod:`jaxcomp.collectives`, :mod:`jaxcomp.feedback`,
:mod:`jaxcomp.bucketing` (the parts of a compressed exchange),
:mod:`jaxcomp.fsdp` and :mod:`jaxcomp.lowcomm` (their layouts' building
blocks), :mod:`jaxcomp.flax`, :mod:`jaxcomp.checkpoint` and
:mod:`jaxcomp.distributed` (multi-host), :mod:`jaxcomp.perfmodel`,
:mod:`jaxcomp.hlo` and :mod:`jaxcomp.kernels`. ``jaxcomp.__all__`` lists
this module's names by task, in the order the API reference documents
them.
"""

from jaxcomp import bucketing
from jaxcomp import checkpoint
from jaxcomp import collectives
from jaxcomp import combinators
from jaxcomp import compressors
from jaxcomp import distributed
from jaxcomp import feedback
from jaxcomp import fsdp
from jaxcomp import gspmd
from jaxcomp import layouts
from jaxcomp import lowcomm
from jaxcomp import optimizers
from jaxcomp import placement
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

# A shard_map train step: one init, one step builder, the layouts.
from jaxcomp.train import TrainState
from jaxcomp.train import init
from jaxcomp.train import make_train_step
from jaxcomp.layouts import DataParallel
from jaxcomp.layouts import FSDP
from jaxcomp.layouts import Islands
from jaxcomp.placement import PlacementError
from jaxcomp.placement import per_device_grad
from jaxcomp.placement import per_device_value_and_grad

# A jax.jit (GSPMD) step.
from jaxcomp.gspmd import compressed_value_and_grad

# Low-communication training.
from jaxcomp.lowcomm import demo
from jaxcomp.lowcomm import diloco
# Compressed optimizers.
from jaxcomp.optimizers import onebit_adam
from jaxcomp.optimizers import onebit_lamb
from jaxcomp.optimizers import zero_one_adam

# Reading a compiled step.
from jaxcomp.hlo.traffic import CollectiveOp
from jaxcomp.hlo.traffic import Traffic
from jaxcomp.hlo.traffic import collective_traffic

__version__ = "0.1.0"

__all__ = [
    # The transform and its state.
    "compressed_mean", "CompressedMeanState", "CompressionStats", "ExchangeStats",
    "get_stats", "transform_configs",
    # Combinators around it.
    "apply_if_finite", "multi_steps", "sparsity_warmup",
    # A shard_map train step: one init, one step builder, the layouts.
    "init", "make_train_step", "TrainState", "DataParallel", "FSDP",
    "Islands", "per_device_value_and_grad", "per_device_grad",
    "PlacementError",
    # A jax.jit (GSPMD) step.
    "compressed_value_and_grad",
    # Low-communication training.
    "diloco", "demo",
    # Compressed optimizers.
    "onebit_adam", "zero_one_adam", "onebit_lamb",
    # Reading a compiled step.
    "collective_traffic", "Traffic", "CollectiveOp",
]
