"""CUDA C++ sources of tidearray's kernels, compiled at run time by CuPy (``RawModule``).

This directory is shipped as the package ``tidearray.kernels``; the ``.cu`` and
``.cuh`` files are package data, found next to this file.
"""
