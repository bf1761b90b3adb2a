"""DeepSpeed's compressed optimizers as Optax transformations that own
their exchange: :func:`onebit_adam` (1-bit Adam), :func:`zero_one_adam`
(0/1 Adam, with local steps: one copy of the parameters per device,
``layout=jaxcomp.Islands()``) and :func:`onebit_lamb` (1-bit LAMB). Run them inside
``jax.shard_map`` with each device's own gradient (:func:`jaxcomp.init`
and :func:`jaxcomp.make_train_step` do), with no ``compressed_mean``
before them.

Adam's variance is not linear in the gradient, so error feedback on a
compressed gradient does not carry over to Adam; 1-bit Adam instead runs
dense Adam while the variance settles, freezes it, and then compresses
the momentum (the one quantity left that is linear in the gradients) with
DeepSpeed's 1-bit all-reduce: sign and scale, with the compression error
kept both by each worker and by the device that reduces each chunk (the
"server"). :func:`jaxcomp.get_stats` reads the bytes of each phase from
the state (:class:`jaxcomp.transform.OneBitTraffic`).

References:
  Tang et al., 1-bit Adam: Communication Efficient Large-Scale Training
  with Adam's Convergence Speed <https://arxiv.org/abs/2102.02888>, ICML
  2021; Lu et al., Maximizing Communication Efficiency for Large-scale
  Training via 0/1 Adam <https://arxiv.org/abs/2202.06009>, ICLR 2023;
  Li et al., 1-bit LAMB: Communication Efficient Large-Scale
  Large-Batch Training with LAMB's Convergence Speed
  <https://arxiv.org/abs/2104.06069>, HiPC 2022.
"""

from jaxcomp.optimizers._exchange import compressed_allreduce
from jaxcomp.optimizers._exchange import init_errors
from jaxcomp.optimizers._exchange import phase_transfers
from jaxcomp.optimizers._exchange import OptimizerConfig
from jaxcomp.optimizers._find import compressed_optimizers_in
from jaxcomp.optimizers._find import optimizer_configs
from jaxcomp.optimizers._onebit_adam import OneBitAdamState
from jaxcomp.optimizers._onebit_adam import onebit_adam
from jaxcomp.optimizers._onebit_lamb import OneBitLambState
from jaxcomp.optimizers._onebit_lamb import onebit_lamb
from jaxcomp.optimizers._zero_one_adam import ZeroOneAdamState
from jaxcomp.optimizers._zero_one_adam import zero_one_adam
