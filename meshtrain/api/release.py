"""meshtrain's release: one version for the package, the chart and both images.

pyproject.toml reads it (setuptools' dynamic version), ``scripts/chart-package.sh``
and ``scripts/images.sh`` read it, and a test holds the chart's ``version`` and
``appVersion`` equal to it.
"""

VERSION = "0.3.0"
