"""Multi-process (multi-host) jobs: start-up, the global mesh, global arrays
and a cross-process consistency check (checkpoints: :mod:`jaxcomp.checkpoint`).

A multi-host job runs one Python process per host (or per GPU); they meet
through ``jax.distributed.initialize`` and then see one global list of
devices. Everything in jaxcomp then works unchanged on a mesh built from those
devices (:func:`global_mesh`): ``jaxcomp.init``, ``jaxcomp.make_train_step`` and
``compressed_mean`` see global arrays, and each process holds only the shards
of its own devices.

* :func:`initialize_from_env` joins the job: explicit arguments, else the
  ``JAXCOMP_*`` variables that :mod:`jaxcomp.launch` sets, else JAX's own
  cluster auto-detection (SLURM, Open MPI, Kubernetes, Cloud TPU), else a
  plain single-process run.
* :func:`global_mesh` builds the ``("hosts", "devices")`` mesh, so that
  compression can be applied over the slow axis only.
* :func:`global_array` puts host values every process holds on the mesh.
* :func:`check_consistency` fails loudly when processes (or devices) hold
  different copies of what must be identical: parameters and shared
  compressor state.
* a peer watcher (started by :func:`initialize_from_env`): when a process of
  the job dies, every survivor exits on its own with one line naming it and
  the last complete checkpoint (:data:`PEER_LOST_EXIT_CODE`), instead of
  hanging in a collective or being aborted by JAX's coordination service.
"""

from jaxcomp.distributed._arrays import global_array
from jaxcomp.distributed._arrays import global_mesh
from jaxcomp.distributed._checks import AgreementError
from jaxcomp.distributed._checks import ConsistencyError
from jaxcomp.distributed._checks import check_agreement
from jaxcomp.distributed._checks import check_consistency
from jaxcomp.distributed._preemption import preemption_requested
from jaxcomp.distributed._startup import DEFAULT_HEARTBEAT_TIMEOUT
from jaxcomp.distributed._startup import ENV_COORDINATOR
from jaxcomp.distributed._startup import ENV_HEARTBEAT
from jaxcomp.distributed._startup import ENV_NUM_PROCESSES
from jaxcomp.distributed._startup import ENV_PROCESS_ID
from jaxcomp.distributed._startup import ENV_WATCH_PEERS
from jaxcomp.distributed._startup import check_address
from jaxcomp.distributed._startup import initialize_from_env
from jaxcomp.distributed._watch import PEER_LOST_EXIT_CODE
from jaxcomp.distributed._watch import note_checkpoint
from jaxcomp.distributed._watch import shutdown
from jaxcomp.distributed._watch import watching_peers

__all__ = [
    "ENV_COORDINATOR",
    "ENV_NUM_PROCESSES",
    "ENV_PROCESS_ID",
    "ENV_HEARTBEAT",
    "ENV_WATCH_PEERS",
    "DEFAULT_HEARTBEAT_TIMEOUT",
    "ConsistencyError",
    "AgreementError",
    "check_address",
    "initialize_from_env",
    "PEER_LOST_EXIT_CODE",
    "watching_peers",
    "note_checkpoint",
    "shutdown",
    "preemption_requested",
    "global_mesh",
    "global_array",
    "check_agreement",
    "check_consistency",
]
