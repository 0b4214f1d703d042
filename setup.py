"""Build script; metadata, dependencies and extras live in setup.cfg."""

from setuptools import find_packages, setup

setup(
    # The .cu sources sit at the top level (kernels/) so the CUDA engineer can
    # edit them without digging into the package; they ship as tidearray.kernels.
    # kernels/ has no __init__.py on purpose: run from the checkout (python -m pytest,
    # mpiexec ... -m), a regular package there would shadow the Hugging Face `kernels`
    # distribution, which transformers requires and imports.
    # The library only: benchmarks/ (harness, baselines, probes, records) and tests/ are
    # never packaged (MANIFEST.in keeps benchmarks/ and the records out of the sdist too).
    packages=find_packages(include=["tidearray", "tidearray.*"],
                           exclude=["benchmarks", "benchmarks.*", "tests", "tests.*"])
    + ["tidearray.kernels"],
    package_dir={"tidearray.kernels": "kernels"},
)
