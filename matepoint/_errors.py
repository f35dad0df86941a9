"""The one wording of matepoint's errors for a bad argument.

Every public function that refuses an argument says so as
``matepoint.<function>: <argument> must be <what it accepts>, got <what it
got>``: a TypeError for the wrong type, a ValueError for a value out of
range. What it got is shown short (a tensor or a model is named by its
type, not printed whole; a huge int by its size).
"""
from __future__ import annotations

import types
from typing import Any

import torch.nn as nn

from matepoint._options import show_int

# a repr longer than this is replaced by the value's type
_MAX_REPR = 80


def describe(value: Any) -> str:
    """``value`` as an error message shows it."""
    if isinstance(value, int) and not isinstance(value, bool):
        return show_int(value)
    if isinstance(value, type):
        return f"the class {value.__module__}.{value.__qualname__}"
    if isinstance(value, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
        return f"the function {getattr(value, '__qualname__', value)}"
    if value is None or isinstance(value, (bool, float, str, bytes)):
        shown = repr(value)
        if len(shown) <= _MAX_REPR:
            return shown
    return f"a {type(value).__name__}"


def type_error(where: str, argument: str, accepted: str, value: Any) -> TypeError:
    """The TypeError for ``argument`` of ``where`` (``"matepoint.enable"``)."""
    return TypeError(f"{where}: {argument} must be {accepted}, got {describe(value)}")


def value_error(where: str, argument: str, accepted: str, value: Any) -> ValueError:
    """The ValueError for ``argument`` of ``where``."""
    return ValueError(f"{where}: {argument} must be {accepted}, got {describe(value)}")


def check_module(where: str, argument: str, value: Any) -> None:
    """TypeError unless ``value`` is a module instance (a module class, such
    as ``nn.Linear`` without parentheses, is refused too)."""
    if not isinstance(value, nn.Module):
        raise type_error(where, argument, "a torch.nn.Module instance", value)
