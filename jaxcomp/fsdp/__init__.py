"""Sharded data parallelism (FSDP / ZeRO-3) with a compressed reduce-scatter.

Each parameter leaf of ``n`` elements is held as a *flat shard*: flattened,
zero-padded to ``p * c`` elements (``c = ceil(n / p)``, ``p`` devices on the
data axis) and split so that device ``j`` holds elements ``[j c, (j + 1) c)``
(ZeRO-3's flat partitioning). A step, per device under ``jax.shard_map``:

1. all-gather the shards into the whole parameters (:func:`gather_params`);
2. take this device's gradient of its loss with respect to the *gathered*
   parameters (:func:`value_and_grad`): per device, whole-shaped;
3. ``jaxcomp.compressed_mean(..., output="shard")`` exchanges it by a
   compressed reduce-scatter and returns this device's shard of the mean;
4. the optimizer after it updates the shards; its state is sharded too.

Parameters and optimizer state take about ``1 / p`` of the replicated
memory per device; error feedback, where used, adds one whole-gradient
float32 residual per device (``CompressionStats.state_bytes``).

The JAX fact behind step 2: inside ``shard_map``, the transpose of
``lax.all_gather`` is ``lax.psum_scatter``, so ``jax.grad`` of a loss of
gathered parameters with respect to the *shards* returns a gradient JAX has
already reduce-scattered, dense and in float32: nothing would be left to
compress. Differentiating with respect to the gathered parameters, marked
varying, keeps each device's own gradient (tests/test_fsdp.py checks both).

The layout is :class:`jaxcomp.FSDP`, placed by :func:`jaxcomp.init` and
stepped by :func:`jaxcomp.make_train_step`; the functions here are its
building blocks.

Example:
  >>> import jax, jax.numpy as jnp, optax, jaxcomp
  >>> from jax.sharding import NamedSharding, PartitionSpec as P
  >>> mesh = jax.make_mesh((jax.device_count(),), ("data",))
  >>> tx = optax.chain(
  ...     jaxcomp.compressed_mean("int8_block", "data", output="shard",
  ...                             rounding="stochastic"),  # qgZ's choice
  ...     optax.sgd(0.1))
  >>> state = jaxcomp.init(tx, {"w": jnp.ones((100, 3))}, mesh,
  ...                      layout=jaxcomp.FSDP())
  >>> state.params["w"].shape  # 300 elements: 38 per device (8), zero-padded
  (304,)
  >>> def loss_fn(params, x):
  ...   return jnp.mean((x @ params["w"]) ** 2)
  >>> step = jaxcomp.make_train_step(loss_fn, tx, mesh=mesh,
  ...                                layout=jaxcomp.FSDP())
  >>> x = jax.device_put(jnp.ones((16, 100)), NamedSharding(mesh, P("data")))
  >>> state, loss = step(state, x)
  >>> float(loss)
  10000.0
  >>> state.model_params()["w"].shape
  (100, 3)

References:
  Rajbhandari et al., ZeRO: Memory Optimizations Toward Training Trillion
  Parameter Models <https://arxiv.org/abs/1910.02054>, 2020; Zhao et al.,
  PyTorch FSDP <https://arxiv.org/abs/2304.11277>, 2023; Wang et al.,
  ZeRO++ <https://arxiv.org/abs/2306.10209>, 2023 (qgZ: the quantized
  gradient reduce-scatter by all-to-all).
"""

from jaxcomp.fsdp._layout import FSDP
from jaxcomp.fsdp._shards import gather_params
from jaxcomp.fsdp._shards import shard_params
from jaxcomp.fsdp._shards import state_bytes
from jaxcomp.fsdp._shards import unshard_params
from jaxcomp.fsdp._shards import value_and_grad

__all__ = ["FSDP", "gather_params", "shard_params", "state_bytes",
           "unshard_params", "value_and_grad"]
