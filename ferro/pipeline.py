"""``ferro.pipeline``: the very module :mod:`ferro.parallel.pipeline` (not a copy), loaded on first use."""

import sys

from ferro.parallel import pipeline as _pipeline

sys.modules[__name__] = _pipeline
