"""Operators that other libraries define run their executor kernel on superchip.

Contract
--------
- An operator outside aten that has a kernel for the executor's device (CPU or CUDA) and a
  composite one (torch.library's "default" kernel) runs the executor's kernel for superchip
  tensors, as the executor does for its own (Note [Other libraries' operators],
  backend/register/Registration.cpp). Without a kernel for the executor's device, the composite
  runs, as it does on the executor. Operators with a Device or Storage argument keep their
  composite.
- Every operator is checked when superchip is imported, all of them again after each
  ``torch.ops.load_library``, and one operator each time torch.library's ``Library`` defines
  it or registers a kernel for it (``custom_op``, ``register_kernel``, ``impl``, ``define``).
- A forwarding registration made for a ``Library``'s registration is that ``Library``'s: it
  goes when the ``Library`` is destroyed (a scoped library) or collected. One made at import
  or after ``load_library`` lasts for the process. Either goes when a later check finds the
  operator no longer qualifies.
- A superchip kernel registered by anyone else (``register_kernel(op, "superchip")``) is
  never displaced: the forwarding kernel is only registered where none exists, and a later one
  outranks it.
- A check that fails never breaks the registration that called it: it becomes a warning.
- Not seen: operators registered from C++ by an extension module imported after superchip
  other than through ``torch.ops.load_library``; their composite keeps running on superchip.
"""

from __future__ import annotations

import warnings

import torch

from . import _C
from ._after_import import wrapping

# "ns::op[.overload]" -> its forwarding registration (superchip._C._ForwardingRegistration).
_FORWARDED: dict[str, object] = {}


def _check(name: str, library=None) -> None:
    """Registers the forwarding kernel for ``name`` where it qualifies, owned by ``library``
    when given; drops superchip's registration where it no longer does."""
    ours = _FORWARDED.get(name)
    if ours is not None and not ours.alive:  # destroyed with the Library that held it
        del _FORWARDED[name]
        ours = None
    if not _C._executor_kernel_outranked(name):
        if ours is not None:
            ours.destroy()
            del _FORWARDED[name]
        return
    if ours is not None or torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"):
        return
    registration = _C._register_forwarding(name)
    _FORWARDED[name] = registration
    handles = getattr(library, "_registration_handles", None)  # torch 2.11-2.13 have it
    if handles is not None:
        handles.append(registration)


def _check_all() -> None:
    for name in list(_FORWARDED):
        _check(name)
    for name in _C._outranked_executor_kernels():
        _check(name)


def _guarded(check, *args) -> None:
    try:
        check(*args)
    except Exception as e:  # never break the other library's registration
        warnings.warn(f"superchip: could not route an operator to the executor's kernel: {e}", stacklevel=3)


def _op_name(library, op) -> str:
    """The dispatcher's name, "ns::op[.overload]", of what ``Library.impl`` was given."""
    if isinstance(op, torch._ops.OpOverload):
        schema = op._schema
        return schema.name + (f".{schema.overload_name}" if schema.overload_name else "")
    op = str(op)
    return op if "::" in op else f"{library.ns}::{op}"


def install() -> None:
    Library = torch.library.Library
    if getattr(Library.impl, "_superchip", False):
        return
    impl, define = Library.impl, Library.define
    load_library = torch._ops._Ops.load_library

    def impl_then_check(self, op_name, *args, **kwargs):
        result = impl(self, op_name, *args, **kwargs)
        if self.ns != "aten":
            _guarded(_check, _op_name(self, op_name), self)
        return result

    def define_then_check(self, schema, *args, **kwargs):
        result = define(self, schema, *args, **kwargs)
        name = schema.split("(")[0].split("::")[-1].strip()
        _guarded(_check, f"{self.ns}::{name}", self)
        return result

    def load_library_then_check(self, path):
        result = load_library(self, path)
        _guarded(_check_all)
        return result

    Library.impl = wrapping(impl_then_check, impl)
    Library.define = wrapping(define_then_check, define)
    torch._ops._Ops.load_library = wrapping(load_library_then_check, load_library)
    _guarded(_check_all)
