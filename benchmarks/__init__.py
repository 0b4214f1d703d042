"""tidearray's benchmarks: the harness, the baselines and the step comparisons.

Not part of the package (nothing here is installed); run from the repository root::

    mpirun -n 2 python -m benchmarks all --out DIR

``benchmarks/README.md`` lists every suite, baseline and step comparison.
"""
