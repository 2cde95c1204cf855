"""Package discovery for the one distribution (metadata lives in pyproject.toml).

`operator/` is installed as `llumnix_operator` so it cannot shadow the standard library's
`operator` module; setuptools' `find_packages` cannot rename, hence this file.
"""

from setuptools import find_packages, setup

packages = find_packages(include=["llumnix", "llumnix.*", "llumlet", "llumlet.*"])
packages += ["llumnix_operator"] + [f"llumnix_operator.{p}" for p in find_packages(where="operator")]

setup(packages=packages)
