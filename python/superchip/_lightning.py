"""Lightning on superchip: ``lightning.pytorch.Trainer`` and ``lightning.fabric.Fabric`` train on
the superchip device, as their CUDA accelerator trains on a GPU.

Contract
--------
Each holds whether superchip is imported before or after lightning.

- An accelerator named ``"superchip"`` (``SuperchipAccelerator``, ``accelerator_class(package)``)
  is in the registries of lightning.pytorch and lightning.fabric (and of the packages
  ``pytorch_lightning`` and ``lightning_fabric``, where those are installed):
  ``Trainer(accelerator="superchip", devices=...)`` and
  ``Fabric(accelerator="superchip", ...)``. ``devices`` is a count (the first N superchip
  devices), a list of indices, ``-1`` (all) or ``"auto"`` (all); an index past
  ``torch.superchip.device_count()`` raises naming the count.
- ``accelerator="auto"`` (the default) picks superchip in a process that imports it, as
  ``torch.accelerator`` and Hugging Face's ``Trainer`` do (Note [Lightning's accelerator]);
  ``"cpu"``, ``"cuda"``/``"gpu"``, ``"mps"`` and TPUs stay Lightning's.
- ``precision="bf16-mixed"`` / ``"16-mixed"`` autocast on superchip (``torch.autocast("superchip",
  ...)``), fp16 with ``torch.amp.GradScaler("superchip")``, where Lightning would name "cuda" for
  any accelerator other than the CPU and MPS (and autocast nothing on superchip tensors).
- Several superchip devices (or processes) run Lightning's DDP with the process group
  backend ``"cpu:gloo,superchip:sccl"`` (superchip tensors through sccl, CPU ones through Gloo),
  unless the strategy names one, and ``DistributedDataParallel`` without ``device_ids`` (as
  torch.distributed runs it on superchip; Lightning passes ids, with a CUDA stream, for any
  device but the CPU).
- ``get_device_stats`` is ``superchip.memory_stats()`` (both tiers), what Lightning's
  ``DeviceStatsMonitor`` logs. The accelerator pickles (``strategy="ddp_spawn"``).
- Lightning's FSDP and DeepSpeed strategies stay refused by Lightning itself ("requires a GPU
  accelerator"); torch's FSDP2 on superchip modules, or transformers' ``Trainer(fsdp=...)``,
  shard instead.

Note [Lightning's accelerator]
Lightning knows a fixed set of accelerators (CPU, CUDA, MPS, XLA) and chooses among them for
``accelerator="auto"``; a LightningModule on superchip handed to ``Trainer()`` was moved to the
CPU (or to plain CUDA with the CUDA executor) and trained there, silently, and
``accelerator="superchip"`` raised "invalid accelerator name". Lightning registers accelerators
by name in a registry that takes new ones (Habana's and others' plugins do so); superchip's
joins it. "auto" follows torch: when superchip is registered, ``torch.accelerator`` is
superchip, and superchip's other integrations (accelerate, transformers' ``Trainer`` and
pipelines) train on it too; a script that wants the GPU itself names "cuda".
"""

from __future__ import annotations

import torch

from ._after_import import rebind, wrapping as _mark

# The process group of superchip's processes (as _huggingface's and the README's).
_PROCESS_GROUP_BACKEND = "cpu:gloo,superchip:sccl"


def _parse_devices(devices) -> list[int]:
    count = torch.superchip.device_count()
    if isinstance(devices, str):
        devices = devices.strip()
        if devices == "auto" or devices == "-1":
            devices = -1
        elif "," in devices:
            devices = [int(d) for d in devices.split(",") if d.strip()]
        else:
            devices = int(devices)
    if isinstance(devices, int):
        if devices == -1:
            return list(range(count))
        if devices <= 0:
            raise ValueError(f"superchip: devices={devices} asks for no superchip device; give a count of at least 1, "
                             "a list of indices, -1 or 'auto'")
        indices = list(range(devices))
    else:
        indices = [int(d) for d in devices]
    bad = [i for i in indices if not 0 <= i < count]
    if bad or not indices:
        raise ValueError(f"superchip: devices={devices!r} names superchip device(s) {bad or indices} but this process "
                         f"has {count} (indices 0..{count - 1}); SUPERCHIP_DEVICE_COUNT or the GPUs set the count")
    return indices


class _Superchip:
    """The methods of superchip's accelerator, for Lightning's two Accelerator bases."""

    _superchip_accelerator = True

    def setup_device(self, device: torch.device) -> None:
        if device.type != "superchip":
            raise ValueError(f"superchip: the superchip accelerator was given device {device}")
        torch.superchip.set_device(device)

    def teardown(self) -> None:
        pass

    @staticmethod
    def parse_devices(devices) -> list[int]:
        return _parse_devices(devices)

    @staticmethod
    def get_parallel_devices(devices) -> list[torch.device]:
        return [torch.device("superchip", i) for i in _parse_devices(devices)]

    @staticmethod
    def auto_device_count() -> int:
        return torch.superchip.device_count()

    @staticmethod
    def is_available() -> bool:
        return torch.superchip.device_count() > 0

    @staticmethod
    def name() -> str:
        return "superchip"

    def get_device_stats(self, device) -> dict:
        import superchip

        return superchip.memory_stats(device)

    @classmethod
    def register_accelerators(cls, accelerator_registry) -> None:
        accelerator_registry.register("superchip", cls, description=cls.__name__)


# Lightning ships as one package (lightning.pytorch, lightning.fabric) and as two
# (pytorch_lightning, lightning_fabric), with the same modules under each name.
_TRAINER_PACKAGES = ("lightning.pytorch", "pytorch_lightning")
_FABRIC_PACKAGES = ("lightning.fabric", "lightning_fabric")

_CLASSES: dict[str, type] = {}
# Each package's class by the name it is found under here (pickle finds a class by its module and
# name: ddp_spawn sends the accelerator to its processes).
_NAMES = {"lightning.pytorch": "SuperchipAccelerator", "lightning.fabric": "SuperchipFabricAccelerator",
          "pytorch_lightning": "SuperchipPLAccelerator", "lightning_fabric": "SuperchipLFAccelerator"}


def accelerator_class(package: str = "lightning.pytorch") -> type:
    """``SuperchipAccelerator`` for one of Lightning's packages (``lightning.pytorch``,
    ``lightning.fabric``, ``pytorch_lightning``, ``lightning_fabric``)."""
    if package not in _CLASSES:
        import importlib

        base = importlib.import_module(f"{package}.accelerators").Accelerator
        name = _NAMES[package]
        _CLASSES[package] = type(name, (_Superchip, base),
                                 {"__doc__": f"{package}'s accelerator for the superchip device.",
                                  "__module__": __name__, "__qualname__": name})
    return _CLASSES[package]


def __getattr__(name: str):
    for package, class_name in _NAMES.items():
        if name == class_name:
            return accelerator_class(package)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _is_superchip(connector) -> bool:
    accelerator = getattr(connector, "accelerator", None)
    return getattr(accelerator, "_superchip_accelerator", False) or getattr(connector, "_accelerator_flag", None) == "superchip"


def _patch_connector(connector_cls) -> None:
    """accelerator="auto" picks superchip; one device's strategy and mixed precision are on it."""
    choose = connector_cls.__dict__.get("_choose_auto_accelerator")
    if isinstance(choose, staticmethod) and not getattr(choose.__func__, "_superchip", False):
        original_choose = choose.__func__

        def _choose_auto_accelerator(*args, **kwargs) -> str:
            chosen = original_choose(*args, **kwargs)
            if chosen in ("cpu", "cuda", "mps") and _Superchip.is_available():
                return "superchip"
            return chosen

        connector_cls._choose_auto_accelerator = staticmethod(_mark(_choose_auto_accelerator, original_choose))

    choose_strategy = connector_cls._choose_strategy
    if not getattr(choose_strategy, "_superchip", False):
        def _choose_strategy(self):
            strategy = choose_strategy(self)
            # One device: Lightning's single-device strategy sits on the CPU for any accelerator
            # but CUDA, MPS and XLA.
            devices = getattr(self, "_parallel_devices", None) or []
            if (_is_superchip(self) and len(devices) == 1 and not isinstance(strategy, str)
                    and getattr(strategy, "root_device", None) == torch.device("cpu")):
                return type(strategy)(device=devices[0])
            return strategy

        connector_cls._choose_strategy = _mark(_choose_strategy, choose_strategy)

    init_precision = connector_cls._check_and_init_precision
    if getattr(init_precision, "_superchip", False):
        return

    def _check_and_init_precision(self):
        plugin = init_precision(self)
        if _is_superchip(self) and getattr(plugin, "device", None) == "cuda" and hasattr(plugin, "scaler"):
            # Lightning names "cuda" for any accelerator but the CPU and MPS: autocast and the
            # scaler are made again for superchip.
            return type(plugin)(precision=plugin.precision, device="superchip")
        return plugin

    connector_cls._check_and_init_precision = _mark(_check_and_init_precision, init_precision)


def _patch_backend(fabric: str) -> None:
    import importlib

    distributed = importlib.import_module(f"{fabric}.utilities.distributed")
    original = distributed._get_default_process_group_backend_for_device
    if getattr(original, "_superchip", False):
        return

    def _get_default_process_group_backend_for_device(device: torch.device) -> str:
        if device.type == "superchip":
            return _PROCESS_GROUP_BACKEND
        return original(device)

    # The strategies import the function by name: every module's binding of it.
    rebind("_get_default_process_group_backend_for_device", original,
           _mark(_get_default_process_group_backend_for_device, original))


def _patch_ddp_device_ids(strategy_cls, method: str) -> None:
    """DDP around a superchip module without ``device_ids`` (and without Lightning's
    ``torch.cuda.Stream``, which it makes whenever there are device ids)."""
    original = getattr(strategy_cls, method)
    if getattr(original, "_superchip", False):
        return

    def determine(self):
        if self.root_device.type == "superchip":
            return None
        return original(self)

    setattr(strategy_cls, method, _mark(determine, original))


def _patch_trainer(package: str) -> None:
    import importlib

    registry = importlib.import_module(f"{package}.accelerators").AcceleratorRegistry
    connector = importlib.import_module(f"{package}.trainer.connectors.accelerator_connector")
    if "superchip" not in registry:
        accelerator_class(package).register_accelerators(registry)
    _patch_connector(connector._AcceleratorConnector)
    _patch_backend("lightning.fabric" if package == "lightning.pytorch" else "lightning_fabric")
    _patch_ddp_device_ids(importlib.import_module(f"{package}.strategies").DDPStrategy, "determine_ddp_device_ids")


def _patch_fabric(package: str) -> None:
    import importlib

    registry = importlib.import_module(f"{package}.accelerators").ACCELERATOR_REGISTRY
    if "superchip" not in registry:
        accelerator_class(package).register_accelerators(registry)
    _patch_connector(importlib.import_module(f"{package}.connector")._Connector)
    _patch_backend(package)
    _patch_ddp_device_ids(importlib.import_module(f"{package}.strategies").DDPStrategy, "_determine_ddp_device_ids")


def install() -> None:
    """Registers superchip with Lightning now if it is loaded, else right after it loads."""
    import functools

    from ._after_import import after_import

    for package in _TRAINER_PACKAGES:
        after_import(f"{package}.trainer.connectors.accelerator_connector", functools.partial(_patch_trainer, package),
                     f"{package}'s Trainer could not be given the superchip accelerator")
    for package in _FABRIC_PACKAGES:
        after_import(f"{package}.connector", functools.partial(_patch_fabric, package),
                     f"{package}'s Fabric could not be given the superchip accelerator")
