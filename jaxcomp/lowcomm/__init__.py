"""Low-communication training: DiLoCo (and Streaming DiLoCo, SparseLoCo's
compressed pseudo-gradients) and DeMo.

* :func:`diloco` : ``H`` local steps per
  device, then an outer step on the compressed mean of the pseudo-gradients;
  :func:`jaxcomp.init` and :func:`jaxcomp.make_train_step` with the
  :class:`Islands` layout place and step it (each device, or island, keeps
  its own parameters between syncs).
* :func:`demo` : decoupled momentum, its fast
  DCT components all-gathered every step.
"""

from jaxcomp.lowcomm._demo import DeMoState
from jaxcomp.lowcomm._demo import demo
from jaxcomp.lowcomm._demo import demo_bytes
from jaxcomp.lowcomm._demo import demo_momentum
from jaxcomp.lowcomm._diloco import DiLoCoState
from jaxcomp.lowcomm._diloco import LowCommTraffic
from jaxcomp.lowcomm._diloco import diloco
from jaxcomp.lowcomm._diloco import holds_diloco
from jaxcomp.lowcomm._diloco import outer_step
from jaxcomp.lowcomm._diloco import per_device_copies
from jaxcomp.lowcomm._diloco import pseudo_gradient
from jaxcomp.lowcomm._diloco import snap_to_anchor
from jaxcomp.lowcomm._diloco import synced_params
from jaxcomp.lowcomm._diloco import traffic
from jaxcomp.lowcomm._layout import Islands
