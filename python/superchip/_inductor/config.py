"""Superchip's Inductor code-generation config, registered with the backend.

Inductor keys its FX graph cache on each device's registered config, not on the code of the
device's code generator; ``codegen_version`` (a hash of the ``superchip/_inductor`` sources)
makes the key change with superchip's generator, so a graph compiled and cached by another
version of it is never reused.
"""

# No ``from __future__ import annotations`` here: install_config_module takes every module
# attribute that is not a module or a function for a config entry.
import hashlib
import pathlib
import sys

from torch.utils._config_module import install_config_module


def _sources_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(pathlib.Path(__file__).parent.glob("*.py")):
        digest.update(path.name.encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


codegen_version: str = _sources_hash()

install_config_module(sys.modules[__name__])
