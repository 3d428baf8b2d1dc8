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
- A ``custom_op`` factory (a ``device`` argument, no tensor) with per-device kernels
  (``register_kernel``) runs for ``device="superchip"`` the kernel of the executor's device,
  given the executor's device, and returns a superchip tensor; without a kernel for the
  executor's device it raises torch's error naming superchip, as it would for that device
  (Note [Factories of other libraries]). This holds for factories defined before superchip is
  imported too.
- A check that fails never breaks the registration that called it: it becomes a warning.
- An operator registered from C++ after import by other means (an extension module's own
  import) is checked when Python first looks it up in ``torch.ops`` (``torch.ops.ns.op``).
  Not seen: such an operator called only from C++, never through ``torch.ops``; its composite
  keeps running on superchip.
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


def _guarded(check, *args):
    """``check(*args)``'s result, or None (and a warning) where it raises."""
    try:
        return check(*args)
    except Exception as e:  # never break the other library's registration
        warnings.warn(f"superchip: could not route an operator to the executor's kernel: {e}", stacklevel=3)


# Note [Factories of other libraries]
# A custom_op without tensor arguments takes a device argument, and once it has per-device
# kernels (register_kernel, or custom_op(device_types=...)) torch dispatches it with a
# BackendSelect kernel that accepts only the device types it has a kernel for: a superchip
# user's `make(n, device="superchip")` raised "does not have a kernel registered for
# superchip" where the executor's device had one. superchip wraps that BackendSelect kernel:
# for a superchip device whose executor's type has a kernel (and superchip none of its own)
# it dispatches to superchip's key, where the forwarding kernel (backend/register/
# Registration.cpp, Note [Other libraries' operators]) or the fallback passes the executor's
# device to the executor's kernel and makes the result superchip's. Anything else goes to
# torch's BackendSelect kernel unchanged, its error included.
def _backend_select(opdef, select, index: int):
    """``select``, torch's BackendSelect kernel of ``opdef``, with superchip's device sent to
    the executor's kernel."""
    executor = _C._executor()
    superchip_key = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)

    def backend_select(keyset, *args, **kwargs):
        device = args[index] if index < len(args) else None
        fns = opdef._backend_fns
        if isinstance(device, torch.device) and device.type == "superchip" \
                and "superchip" not in fns and executor in fns:
            return opdef._opoverload.redispatch(superchip_key, *args, **kwargs)
        return select(keyset, *args, **kwargs)

    backend_select._superchip = True
    return backend_select


def _superchip_aware(library, op_name, fn):
    """``fn``, a BackendSelect kernel ``library`` registers, wrapped by _backend_select where it
    is a custom_op factory's own."""
    opdef, index = _factory_opdef(_op_name(library, op_name))
    if index is None or library is not opdef._lib:  # not custom_op's (prims' iota has its own)
        return fn
    return _backend_select(opdef, fn, index)


def _factory_opdef(name: str):
    """The ``custom_op`` of ``name`` and its device argument's index, where it is a factory."""
    opdef = torch._library.custom_ops.OPDEFS.get(name.split(".")[0])
    if opdef is None:
        return None, None
    schema = opdef._opoverload._schema
    if torch._library.utils.has_tensor_arg(schema):
        return None, None
    return opdef, torch._library.utils.get_device_arg_index(schema)


def _rewrap_factories() -> None:
    """Wraps the BackendSelect kernels of factories defined before superchip was imported."""
    for name, opdef in list(torch._library.custom_ops.OPDEFS.items()):
        # Only custom_op's own BackendSelect kernel, made by register_kernel for a device type:
        # torch's prims are custom ops too, and their factories (prims::iota) have a
        # BackendSelect kernel of their own that must stay.
        ns, op = name.split("::")
        if not any(d is not None for d in opdef._backend_fns) \
                or f"{ns}/{op}/BackendSelect" not in getattr(opdef._lib, "_op_impls", ()):
            continue
        index = _factory_opdef(name)[1]
        if index is None:
            continue
        # Registered again, through Library.impl (so wrapped). torch 2.11's Library.impl
        # refuses a second Python kernel for the key (its own register_kernel does so for a
        # factory's second device type): the key leaves torch's record of them first.
        torch.library._impls.discard(f"{ns}/{op}/BackendSelect")
        with warnings.catch_warnings():  # torch's "Overriding a previously registered kernel"
            warnings.simplefilter("ignore")
            opdef._register_backend_select_dispatcher(index)


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
    lookup = torch._ops._OpNamespace.__getattr__

    def impl_then_check(self, op_name, fn, dispatch_key="", *args, **kwargs):
        if dispatch_key == "BackendSelect" and kwargs.get("with_keyset") \
                and not getattr(fn, "_superchip", False):
            fn = _guarded(_superchip_aware, self, op_name, fn) or fn
        result = impl(self, op_name, fn, dispatch_key, *args, **kwargs)
        if self.ns != "aten":
            _guarded(_check, _op_name(self, op_name), self)
        return result

    def define_then_check(self, schema, *args, **kwargs):
        result = define(self, schema, *args, **kwargs)
        name = schema.split("(")[0].split("::")[-1].strip()
        _guarded(_check, f"{self.ns}::{name}", self)
        return result

    def lookup_then_check(self, op_name):
        packet = lookup(self, op_name)  # cached on the namespace: once per operator
        if self.name != "aten":
            for overload in getattr(packet, "_overload_names", ()):
                _guarded(_check, f"{self.name}::{op_name}" + (f".{overload}" if overload else ""))
        return packet

    def load_library_then_check(self, path):
        result = load_library(self, path)
        _guarded(_check_all)
        return result

    Library.impl = wrapping(impl_then_check, impl)
    Library.define = wrapping(define_then_check, define)
    torch._ops._Ops.load_library = wrapping(load_library_then_check, load_library)
    torch._ops._OpNamespace.__getattr__ = wrapping(lookup_then_check, lookup)
    _guarded(_check_all)
    _guarded(_rewrap_factories)
