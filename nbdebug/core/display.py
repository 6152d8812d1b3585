"""Which panel shows a result object: a registry that the widgets layer fills.

The result types live in ``core`` and ``analysis``, their panels in ``widgets`` (a layer
above, which they never import). A result's ``show()`` asks :func:`show` here, which
calls the viewer registered for the result's class name (or a base class's name).
:func:`nbdebug.widgets.display.register_viewers` registers the panels; ``import nbdebug``
hands it here as a *viewer source* (:func:`add_viewer_source`), run on the first
:func:`show` that finds no viewer, so nothing of the UI is imported before a panel is
shown and no ``%load_ext`` is needed.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_VIEWERS: dict[str, Callable[..., object]] = {}
_SOURCES: list[Callable[[], None]] = []


def add_viewer_source(source: Callable[[], None]) -> None:
    """``source()`` registers viewers; it runs (once) when :func:`show` first needs one."""
    _SOURCES.append(source)


def register_viewer(class_name: str, viewer: Callable[..., object]) -> None:
    """Show objects of the class named ``class_name`` (``type(obj).__name__``) with
    ``viewer(obj, **options)``; registering a name again replaces its viewer."""
    _VIEWERS[class_name] = viewer


def unregister_viewer(class_name: str) -> None:
    """Forget the viewer of ``class_name`` (no error when there is none)."""
    _VIEWERS.pop(class_name, None)


def show(obj: object, **options: object) -> Any:  # the panel widget (an ipywidgets type)
    """The panel for ``obj`` from its registered viewer.

    Raises
    ------
    ImportError
        No viewer is registered for ``obj``'s class (the widgets layer was not loaded).
    """
    viewer = _viewer_for(obj)
    while viewer is None and _SOURCES:
        _SOURCES.pop(0)()
        viewer = _viewer_for(obj)
    if viewer is not None:
        return viewer(obj, **options)
    raise ImportError(
        f"no panel is registered for {type(obj).__qualname__}: the panels are registered "
        "by nbdebug.widgets.display.register_viewers() (`import nbdebug` arranges it)."
    )


def _viewer_for(obj: object) -> Callable[..., object] | None:
    for cls in type(obj).__mro__:
        viewer = _VIEWERS.get(cls.__name__)
        if viewer is not None:
            return viewer
    return None
