"""Elastic DiLoCo islands: each island its own JAX job, the outer sync
through torchft, so that losing an island does not stop the others.

An *island* is one JAX job (one process or several; exact or compressed
data parallelism, or FSDP, over its devices inside, as any jaxcomp step). Islands train on
their own for ``H`` inner steps; at each outer sync every island present
sends its compressed pseudo-gradient (``anchor - local``, with error
feedback) to the others, decodes and averages them in JAX, and takes the
outer step in JAX. Membership is torchft's (Lighthouse quorum, one
``Manager`` per island, a gloo process group re-created per quorum):

* a sync that fails (a peer died mid-interval, a timeout) is reported to
  the manager, ``should_commit`` is false on that island and the interval
  is discarded: no partial average is applied, the anchor, outer state,
  error-feedback residual and step are left as they were, and nothing is
  checkpointed;
* a lost island is dropped at the next quorum (torchft's Lighthouse: no
  heartbeat for ``heartbeat_timeout_ms``), and the survivors average over
  the islands present, each with weight ``1 / islands`` (DiLoCo's mean);
* before the first commit, a quorum of fewer than ``wait_for`` islands is
  asked again (a clean start); a joiner with another configuration is
  refused at its heal and the others commit without it;
* an island that comes back, or a replacement, heals at the quorum: it
  receives the *anchor* (outer parameters, outer-optimizer state, the step,
  the configuration's fingerprint) from a peer through torchft's
  ``state_dict`` hooks (its process-group checkpoint transport, over the
  same gloo group); its own
  error-feedback residual starts at zero (a residual is what *that*
  island has not sent yet: a donor's belongs to the donor);
* the anchor is saved with Orbax at every commit (``checkpoint_dir/<island>``),
  so a replacement started after every peer has gone restores the newest
  anchor of any island instead of starting from step 0.

The package's parts: ``_island`` (the manager, :meth:`ElasticDiLoCo.begin`,
:meth:`ElasticDiLoCo.sync`, the heal, :func:`lighthouse`: the one module of
jaxcomp that imports torch and torchft, ``pip install "jaxcomp[elastic]"``,
and only when an island or a Lighthouse is made, so this package imports
without them); ``_exchange`` (the handshake and the exchange, each island
sending to every other directly, so a dead island fails every survivor's
exchange at once); ``_outer`` (the sync's JAX numerics: lowcomm's
pseudo-gradient and outer step, :mod:`jaxcomp.feedback`'s residual, on one
flat buffer); ``_shares`` (each process of an island sends its share of
that buffer, ``1/M`` of it, or its own block of FSDP-sharded parameters,
and the island gathers the averaged shares where needed); ``_anchor`` (the Orbax checkpoints); :mod:`.launcher`
(``jaxcomp islands`` and ``jaxcomp lighthouse``, :func:`run_islands`).

Example (one island; start one per island, and the Lighthouse once, e.g.
``jaxcomp lighthouse --min-replicas 2``)::

  isl = ElasticDiLoCo(params, island="a", lighthouse="http://host:29510",
                      compressor="int8_block", checkpoint_dir="/ckpt")
  while isl.step < outer_steps:
    params = isl.begin()          # quorum; heals a (re)joining island
    for _ in range(H):
      params, inner_state = train_step(params, inner_state, batch())
    result = isl.sync(params)     # committed or discarded, as a whole

References:
  Douillard et al., DiLoCo: Distributed Low-Communication Training of
  Language Models <https://arxiv.org/abs/2311.08105>, 2023; torchft
  (Manager, Lighthouse, ProcessGroupGloo, PGTransport),
  <https://github.com/pytorch/torchft>, version 0.2.0; Jaghouar et al.,
  INTELLECT-1 Technical Report <https://arxiv.org/abs/2412.01152>, 2024
  (islands joining at outer steps).
"""

from jaxcomp.elastic._common import ElasticConfigError
from jaxcomp.elastic._common import QuorumError
from jaxcomp.elastic._common import SyncResult
from jaxcomp.elastic._common import digest
from jaxcomp.elastic._island import ElasticDiLoCo
from jaxcomp.elastic._island import lighthouse
from jaxcomp.elastic.launcher import run_islands
