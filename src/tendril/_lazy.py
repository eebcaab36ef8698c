"""Lazy public names for packages: resolved from their defining module on first access.

Keeps `import tendril` (and `import tendril.graphs`) cheap: torch, triton and cuda-python load
only when a name that needs them is first used.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any


def lazy_attributes(package: str, names: dict[str, str], namespace: dict[str, Any]) -> Callable[[str], Any]:
    """Return a module `__getattr__` resolving `names` (public name -> defining module) into `namespace`.

    A name whose defining module is `package.name` itself resolves to that submodule.
    """

    def __getattr__(name: str) -> Any:
        module = names.get(name)
        if module is None:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        imported = importlib.import_module(module)
        value = imported if module == f"{package}.{name}" else getattr(imported, name)
        namespace[name] = value
        return value

    return __getattr__
