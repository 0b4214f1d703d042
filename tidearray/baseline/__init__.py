"""The stock path's pieces, shared by the runtime's ``stock`` comm and the benchmark.

* ``pack``: FSDP2's layout conversions (fused copy-in, copy-out and fp32
  chunk-cat kernels from ``kernels/pack.cu``) over a flat layout;
* ``nccl``: NCCL collectives through nccl4py's thin bindings, with the
  library's version and the kernels it may launch.

Neither is part of TIDE; they are what TIDE is measured against, written once.
"""
