"""Run an action right after a module of another package is first executed.

Contract
--------
- ``after_import(name, action, failure)`` runs ``action()`` once, right after the module
  ``name`` has executed (before the statement that imported it goes on), or at once when
  ``name`` is already in ``sys.modules``. Importing superchip never imports ``name``.
- An action that raises never breaks the import: it becomes a warning, ``"superchip:
  <failure>: <error>"``.
- The module is found by the other finders of ``sys.meta_path``, in their order. One whose
  loader has no ``exec_module`` is imported as usual and its action is not run.
- One ``sys.meta_path`` finder serves every pending module and removes itself once none is
  left. A query that finds the module without executing it (``importlib.util.find_spec``)
  leaves its actions pending. Not thread-safe against concurrent first imports of the same module (Python's import
  lock serialises them anyway).
- ``wrapping(new, old)`` marks a patch as superchip's (``new._superchip``, ``new.__wrapped__``),
  so that an action run twice applies it once; ``rebind(name, old, new)`` points every loaded
  module's global ``name`` that is ``old`` at ``new`` (for functions other modules import by
  name before superchip patches them).
"""

from __future__ import annotations

import sys
from typing import Callable

# name -> [(action, what its failure means)], for modules not imported yet.
_PENDING: dict[str, list[tuple[Callable[[], None], str]]] = {}


def _run(action: Callable[[], None], failure: str) -> None:
    try:
        action()
    except Exception as e:  # never break the other package's import
        import warnings

        warnings.warn(f"superchip: {failure}: {e}", stacklevel=3)


class _AfterImports:
    """The finder: runs the pending module as usual, then its actions."""

    def find_spec(self, fullname, path, target=None):
        # Not taken off the list here: find_spec also answers queries (importlib.util.find_spec)
        # that never execute the module; the actions go when the module is executed.
        if fullname not in _PENDING:
            return None
        spec = None
        for finder in list(sys.meta_path):  # the other finders, in order (an editable install's too)
            find = getattr(finder, "find_spec", None)
            if finder is self or isinstance(finder, _AfterImports) or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        execute = loader.exec_module

        def exec_module(module):
            execute(module)
            actions = _PENDING.pop(fullname, [])
            if not _PENDING and self in sys.meta_path:
                sys.meta_path.remove(self)
            for action, failure in actions:
                _run(action, failure)

        loader.exec_module = exec_module
        return spec


def after_import(name: str, action: Callable[[], None], failure: str) -> None:
    """Runs ``action`` right after ``name`` is first imported, or now if it already is."""
    if name in sys.modules:
        _run(action, failure)
        return
    _PENDING.setdefault(name, []).append((action, failure))
    if not any(isinstance(f, _AfterImports) for f in sys.meta_path):
        sys.meta_path.insert(0, _AfterImports())


def wrapping(new, old):
    """Marks ``new`` as superchip's wrapper of ``old``; a patch checks ``_superchip`` on what it
    finds, so it is applied once."""
    new._superchip = True
    new.__wrapped__ = old
    return new


def rebind(name: str, old, new) -> None:
    """Every loaded module's global ``name`` bound to ``old`` now names ``new`` (read from each
    module's ``__dict__``: no lazy module's ``__getattr__`` is triggered)."""
    for module in list(sys.modules.values()):
        names = getattr(module, "__dict__", None)
        if isinstance(names, dict) and names.get(name) is old:
            names[name] = new
