"""ferro's version: the one place it is written.

``pyproject.toml`` reads it at build time (``[tool.setuptools.dynamic]``, statically, without importing ferro),
and ``ferro.__version__``, ``ferro --version`` and the documentation site's header read it at run time.
CHANGELOG.md has a section for each version.
"""

__version__ = "0.1.0"
