"""Trainer callbacks around :class:`nbdebug.NaNGuard`.

- :mod:`nbdebug.integrations.lightning`: ``NaNGuardCallback`` for the Lightning ``Trainer``
  (``pip install nbdebug[lightning]``);
- :mod:`nbdebug.integrations.hf`: ``NaNGuardCallback`` for ``transformers.Trainer``
  (``pip install nbdebug[hf]``).

Each imports its framework when it is imported itself (``import nbdebug`` imports
neither); without the framework its ``NaNGuardCallback`` raises ``ImportError`` with the
install hint.
"""
