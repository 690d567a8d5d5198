"""``ferro.device_mesh``: the very module :mod:`ferro.dtensor.device_mesh` (not a copy), loaded on first use."""

import sys

from ferro.dtensor import device_mesh as _device_mesh

sys.modules[__name__] = _device_mesh
