"""Reading what a compiled program does: the collectives and bytes of a
compiled step (:mod:`jaxcomp.hlo.traffic`) and the structure of the
Pallas kernels in a CUDA export (:mod:`jaxcomp.hlo.kernel_structure`).

Both read compiled or exported modules and run nothing; the library's
training path never imports them.
"""
