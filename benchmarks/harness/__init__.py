"""Benchmarks of tidearray against NCCL and FSDP2's collective path.

Run ``python -m benchmarks --help`` (``mpirun -n N`` for N ranks). Every
run appends JSON records; tables are made from those records
(``python -m benchmarks report``). The kept records are in ``benchmarks/results/``;
``docs/performance.md`` is generated from them (``python -m benchmarks.performance``).
"""
