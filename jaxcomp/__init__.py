"""jaxcomp: gradient compression inside JAX data-parallel collectives.

The public API: :func:`compressed_mean` (an Optax transform), the helpers
that run it under ``jax.shard_map`` (:func:`per_device_grad`,
:func:`init_sharded`, :func:`shard_train_step`), and :func:`collective_traffic`
to read what a compiled step sends.
"""

from jaxcomp import bucketing
from jaxcomp import checkpoint
from jaxcomp import collectives
from jaxcomp import combinators
from jaxcomp import compressors
from jaxcomp import distributed
from jaxcomp import feedback
from jaxcomp import fsdp
from jaxcomp import lowcomm
from jaxcomp import placement
from jaxcomp import sharding
from jaxcomp import steps
from jaxcomp import wire
from jaxcomp.combinators import apply_if_finite
from jaxcomp.combinators import multi_steps
from jaxcomp import warmup
from jaxcomp.warmup import sparsity_warmup
from jaxcomp.inspect.traffic import CollectiveOp
from jaxcomp.inspect.traffic import Traffic
from jaxcomp.inspect.traffic import collective_traffic
from jaxcomp.lowcomm import demo
from jaxcomp.lowcomm import diloco
from jaxcomp.steps import CompressedValueAndGrad
from jaxcomp.steps import compressed_value_and_grad
from jaxcomp.placement import PlacementError
from jaxcomp.placement import init_sharded
from jaxcomp.steps import make_train_step
from jaxcomp.placement import per_device_grad
from jaxcomp.placement import per_device_value_and_grad
from jaxcomp.steps import shard_train_step
from jaxcomp.placement import state_partition_specs
from jaxcomp.placement import to_global
from jaxcomp.placement import to_local
from jaxcomp._mesh import to_varying
from jaxcomp._mesh import varying_axes
from jaxcomp.transform import CompressedMeanState
from jaxcomp.transform import CompressionStats
from jaxcomp.transform import compressed_mean
from jaxcomp.transform import get_stats
from jaxcomp.transform import transform_configs

__version__ = "0.1.0"
