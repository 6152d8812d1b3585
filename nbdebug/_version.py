"""The version of nbdebug: one home, read by the package root and by ``nbdebug.core``."""

__version__ = "0.1.0"
