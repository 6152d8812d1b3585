"""The version of nbdebug: its one home. ``pyproject.toml`` reads it (setuptools' dynamic
``version``), the package root re-exports it as ``nbdebug.__version__`` and snapshots record it."""

__version__ = "0.1.0"
