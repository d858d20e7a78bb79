"""torch and MLX adapters and backends.

Importing this package imports neither framework: ``TorchBackend`` and ``MLXBackend`` load
theirs on first use, and ``adapter_for`` / ``backend_for`` recognise a model by the framework
that made it, which is imported already if the model exists.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import TYPE_CHECKING, Any

from gradientmail.adapters.base import Adapter, Backend, Tensors

if TYPE_CHECKING:
    from gradientmail.adapters.mlx import MLXAdapter, MLXBackend
    from gradientmail.adapters.torch import TorchAdapter, TorchBackend

__all__ = [
    "Adapter",
    "Backend",
    "MLXAdapter",
    "MLXBackend",
    "Tensors",
    "TorchAdapter",
    "TorchBackend",
    "adapter_for",
    "backend_for",
    "default_backend",
]

_LAZY = {
    "TorchAdapter": "gradientmail.adapters.torch",
    "TorchBackend": "gradientmail.adapters.torch",
    "MLXAdapter": "gradientmail.adapters.mlx",
    "MLXBackend": "gradientmail.adapters.mlx",
}
_ACCEPTED = "a torch.nn.Module, an mlx.nn.Module or an Adapter"


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _framework(model: object) -> str | None:
    """ "torch" or "mlx" when ``model`` is a module of that framework; never imports one."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        return "torch"
    nn = sys.modules.get("mlx.nn")
    if nn is not None and isinstance(model, nn.Module):
        return "mlx"
    return None


def backend_for(model: object) -> Backend:
    """The backend of ``model``'s framework: a torch module's on the device of its first
    parameter, an MLX module's on MLX's default device. An ``Adapter`` of ours gets its
    framework's backend, any other ``Adapter`` the ``default_backend``."""
    from_adapter = _adapter_framework(model)
    framework = from_adapter or _framework(model)
    if framework == "torch":
        from gradientmail.adapters.torch import TorchBackend

        module: Any = getattr(model, "module", model)
        first = next(iter(module.parameters()), None)
        return TorchBackend(device=None if first is None else first.device)
    if framework == "mlx":
        from gradientmail.adapters.mlx import MLXBackend

        return MLXBackend()
    if isinstance(model, Adapter):
        return default_backend()
    raise TypeError(f"no backend for a {type(model).__qualname__}; expected {_ACCEPTED}")


def adapter_for(model: object) -> Adapter:
    """The adapter of ``model``: itself when it is an ``Adapter``, else its framework's."""
    if isinstance(model, Adapter):
        return model
    if _framework(model) is None:
        raise TypeError(f"no adapter for a {type(model).__qualname__}; expected {_ACCEPTED}")
    return backend_for(model).adapter(model)


def default_backend() -> Backend:
    """The backend of the installed framework: torch if it is installed, else MLX."""
    if importlib.util.find_spec("torch") is not None:
        from gradientmail.adapters.torch import TorchBackend

        return TorchBackend()
    if importlib.util.find_spec("mlx") is not None:
        from gradientmail.adapters.mlx import MLXBackend

        return MLXBackend()
    raise ImportError(
        "gradientmail needs torch or MLX: pip install 'gradientmail[torch]' or '[mlx]'"
    )


def _adapter_framework(model: object) -> str | None:
    if "gradientmail.adapters.torch" in sys.modules:
        from gradientmail.adapters.torch import TorchAdapter

        if isinstance(model, TorchAdapter):
            return "torch"
    if "gradientmail.adapters.mlx" in sys.modules:
        from gradientmail.adapters.mlx import MLXAdapter

        if isinstance(model, MLXAdapter):
            return "mlx"
    return None
