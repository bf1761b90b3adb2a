"""The names this module held before the step builders became one family
(:mod:`jaxcomp.steps`) and state placement its own module
(:mod:`jaxcomp.placement`), re-exported so that imports of
``jaxcomp.sharding`` keep working.
"""

from jaxcomp._mesh import to_varying
from jaxcomp._mesh import varying_axes
from jaxcomp.placement import init_sharded
from jaxcomp.placement import per_device_grad
from jaxcomp.placement import per_device_value_and_grad
from jaxcomp.placement import state_partition_specs
from jaxcomp.placement import to_global
from jaxcomp.placement import to_local
from jaxcomp.steps import CompressedValueAndGrad
from jaxcomp.steps import compressed_value_and_grad
from jaxcomp.steps import make_train_step
from jaxcomp.steps import shard_train_step
from jaxcomp.steps import step_loss

__all__ = [
    "CompressedValueAndGrad", "compressed_value_and_grad", "init_sharded",
    "make_train_step", "per_device_grad", "per_device_value_and_grad",
    "shard_train_step", "state_partition_specs", "step_loss", "to_global",
    "to_local", "to_varying", "varying_axes",
]
