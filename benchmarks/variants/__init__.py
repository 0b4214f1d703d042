"""Kernel variants kept out of the library: experiments that plug into the library's seams
and are measured against its defaults by the harness and the probes.

- :mod:`benchmarks.variants.accumulate`: the bulk-copy and narrow accumulate kernels
  (``accumulate_bulk.cu``, ``accumulate_narrow.cu`` here), through
  ``Accumulator._select`` in ``tidearray/backends/cuda/accumulate.py``.
"""
