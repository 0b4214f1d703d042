"""Build script; metadata, dependencies and extras live in setup.cfg."""

from setuptools import find_packages, setup

setup(
    # The .cu sources sit at the top level (kernels/) so the CUDA engineer can
    # edit them without digging into the package; they ship as tidearray.kernels.
    packages=find_packages(include=["tidearray", "tidearray.*"]) + ["tidearray.kernels"],
    package_dir={"tidearray.kernels": "kernels"},
)
