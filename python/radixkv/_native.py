"""The one loader of radixkv's optional CUDA extension, `radixkv._cuda`.

`_core` (the CPU kernels, the trees, the copy controller) is always built and
imported directly. `_cuda` exists only where radixkv was built with `nvcc`;
every module that uses it goes through `cuda_extension()` or
`require_cuda_extension()`, so it is imported once, on first use, and
`import radixkv` never loads it.
"""

from __future__ import annotations

import threading
from types import ModuleType
from typing import Optional

_lock = threading.Lock()
_tried = False
_module: Optional[ModuleType] = None
_error: Optional[ImportError] = None


def _load() -> Optional[ModuleType]:
    global _tried, _module, _error
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    from radixkv import _cuda
                except ImportError as e:  # not built, or its CUDA libraries are missing
                    _error = e
                else:
                    _module = _cuda
                _tried = True  # after _module: _tried is read without the lock
    return _module


def cuda_extension() -> Optional[ModuleType]:
    """`radixkv._cuda`, imported on first use; None when it was not built (or
    does not load here)."""
    return _load()


def require_cuda_extension(what: str) -> ModuleType:
    """`radixkv._cuda`; ImportError naming `what` needs it when it is absent,
    chained to the import's own error."""
    module = _load()
    if module is None:
        raise ImportError(
            f"{what} needs radixkv._cuda, the CUDA extension, which was not "
            f"built (no nvcc when radixkv was built) or does not load here: "
            f"{_error}"
        ) from _error
    return module
