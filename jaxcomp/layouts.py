"""The layouts of a ``jax.shard_map`` train step: where the parameters live
on the mesh and how each device takes its own gradient of them. Pass one to
:func:`jaxcomp.init` and :func:`jaxcomp.make_train_step` (the same to
both)::

  jaxcomp.DataParallel()                 # replicated (the default)
  jaxcomp.DataParallel(spec)             # placed by partition specs (tensor
                                         # parallelism written per device)
  jaxcomp.FSDP()                         # flat shards over the data axis:
                                         # FSDP / ZeRO-3
  jaxcomp.FSDP(shard_axis="devices")     # HSDP: sharded inside a host,
                                         # copies across hosts
  jaxcomp.Islands()                      # DiLoCo: one copy per device
  jaxcomp.Islands(over="hosts")          # DiLoCo islands: one copy per host
  jaxcomp.Islands(over="hosts",          # islands with FSDP inside each
                  inside=jaxcomp.FSDP(shard_axis="data"))

Each is defined with its concept: :class:`DataParallel` and the base
:class:`Layout` in :mod:`jaxcomp.steps`, :class:`FSDP` in
:mod:`jaxcomp.fsdp`, :class:`Islands` in :mod:`jaxcomp.lowcomm`.
"""

from jaxcomp.fsdp import FSDP
from jaxcomp.lowcomm import Islands
from jaxcomp.steps import DataParallel
from jaxcomp.steps import Layout

__all__ = ["DataParallel", "FSDP", "Islands", "Layout"]
