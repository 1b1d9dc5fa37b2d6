"""The libc calls the loaders make (mincore, madvise, mallopt), looked up in one place: None where the platform
has no such call, so each caller keeps working without it."""

import ctypes
import sys
from typing import Callable, Optional, Sequence


def function(name: str, argtypes: Optional[Sequence] = None) -> Optional[Callable]:
    """libc's `name` with errno kept (ctypes.get_errno()), or None off Linux or where libc lacks it."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        f = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    if argtypes is not None:
        f.argtypes = list(argtypes)
    return f
