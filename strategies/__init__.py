"""This repository's face over :mod:`pagedkv.testing.strategies`, where the strategies' source lives.

The wheel ships the strategies inside the ``pagedkv`` package only, so it never installs a
top-level ``strategies`` that would collide with a user's own. Here, ``import strategies`` and
``from strategies.batches import ...`` give the very same module objects (no second copy of the
classes), for this repository's own tests and examples. Not packaged (``pyproject.toml``).
"""

import sys

from pagedkv.testing.strategies import *  # noqa: F403
from pagedkv.testing.strategies import __all__  # noqa: F401
from pagedkv.testing.strategies import batches, geometry, invalid, profiles, sharing

for _module in (batches, geometry, invalid, profiles, sharing):
    sys.modules[f"{__name__}.{_module.__name__.rsplit('.', 1)[-1]}"] = _module
