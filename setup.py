"""Package discovery only (metadata lives in pyproject.toml).

The top-level ``kernels/`` folder is mapped into the package as ``lightning_scale.kernels``.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["lightning_scale", "lightning_scale.*"])
packages += ["lightning_scale.kernels"] + [
    "lightning_scale.kernels." + name for name in find_packages(where="kernels")
]
package_dir = {"lightning_scale": "lightning_scale", "lightning_scale.kernels": "kernels"}

setup(packages=packages, package_dir=package_dir)
