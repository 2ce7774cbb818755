"""Argument checks shared by the Python front ends; the native core checks the rest."""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional

import numpy as np
import torch

from radixkv import _core


def as_int(value, name: str) -> int:
    """`value` as an int: Python and NumPy integers, not bools or floats."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got bool")
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def as_int32(value, name: str) -> int:
    """`value` as an int that fits int32 (a priority): TypeError or ValueError naming `name`."""
    value = as_int(value, name)
    if not -(2**31) <= value < 2**31:
        raise ValueError(f"{name} must fit int32, got {value}")
    return value


def as_count(value, name: str, minimum: int = 1) -> int:
    """`value` as an int >= `minimum`; TypeError or ValueError naming `name` otherwise."""
    value = as_int(value, name)
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def per_input(value, count: int, name: str = "namespace") -> Optional[list]:
    """A batch argument given once for all `count` inputs or once per input:
    a list or tuple (one per input: its length must be `count`) comes back
    as a list, anything else (one for all) as None. ValueError naming
    `name` on a length mismatch."""
    if not isinstance(value, (list, tuple)):
        return None
    if len(value) != count:
        raise ValueError(f"{name} has {len(value)} entries but batch has {count}")
    return list(value)


def as_max_slots(value) -> int:
    """`max_slots` for the native tree: None (any slot) becomes -1."""
    if value is None:
        return -1
    value = as_int(value, "max_slots")
    if not 0 <= value <= 2**31:
        raise ValueError(f"max_slots must be in [0, 2**31] or None, got {value}")
    return value


def as_device(device, name: str = "device") -> torch.device:
    """`device` as a torch.device that holds data: the meta device, whose
    tensors have none, is refused, as is anything torch cannot name."""
    if not isinstance(device, (torch.device, str, int)) or isinstance(device, bool):
        raise TypeError(
            f"{name} must be a torch.device or a device name, got " f"{type(device).__name__}"
        )
    try:
        out = torch.device(device)
    except (RuntimeError, ValueError) as e:
        raise ValueError(f"{name}: {e}") from None
    if out.type == "meta":
        raise ValueError(f"{name} must be a device that holds data, got meta")
    return out


def to_host(values, name: str, device: torch.device):
    """Inputs are read on the host. A manager on an accelerator takes tensors
    on any real device (they are copied to the host); a CPU manager takes CPU
    tensors only. Meta tensors have no data and are refused everywhere."""
    # (is_cpu: reading .device makes a torch.device, half a microsecond a call)
    if isinstance(values, torch.Tensor) and not values.is_cpu:
        if device.type == "cpu" or values.is_meta:
            where = "a CPU tensor" if device.type == "cpu" else f"a CPU or {device.type} tensor"
            raise TypeError(f"{name} must be {where}, got a tensor on {values.device}")
        return values.cpu()
    return values


def int32_tensor(values, name: str, device: torch.device) -> torch.Tensor:
    """A checked 1-D int32 CPU tensor holding `values` (any 1-D integer input)."""
    return _core.int32_tensor(to_host(values, name, device), name)


def as_seconds(
    value, name: str, *, positive: bool = False, optional: bool = False, below: float = math.inf
):
    """`value` as a finite number of seconds >= 0 (> 0 when `positive`) and
    below `below`: real numbers (NumPy's too), not bools; None too when
    `optional` (returned as it is: no limit). TypeError or ValueError naming
    `name`. The one check of a duration: a claim's ttl, a fault policy's
    limits, a subscriber's wait."""
    if value is None and optional:
        return None
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a number of seconds, got {type(value).__name__}")
    value = float(value)
    if not math.isfinite(value) or value < 0 or (positive and value == 0) or value >= below:
        bound = f" and below {below:g} s" if below != math.inf else ""
        raise ValueError(
            f"{name} must be a finite number of seconds "
            f"{'> 0' if positive else '>= 0'}{bound}, got {value}"
        )
    return value


def as_flag(value, name: str) -> bool:
    """A bool argument: True or False (NumPy's too), nothing else."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__}")
    return bool(value)
