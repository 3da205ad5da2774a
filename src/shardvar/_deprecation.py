"""The one way shardvar retires a public spelling: it warns for one release, then goes.

Three kinds of spelling are retired here, each through one helper, so every deprecation says the
same thing (the old spelling, the new one, and that the old one goes in the next release):

* a keyword argument: :func:`renamed` (``@renamed(strategy="partition_strategy")``);
* an attribute or property: :func:`deprecated_property`;
* a module-level name: :func:`deprecated_names` (the module's ``__getattr__``).
"""

from __future__ import annotations

import functools
import importlib
import warnings
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

from ._errors import ShardvarTypeError

__all__ = ["renamed", "deprecated_property", "deprecated_names", "warn_renamed"]

F = TypeVar("F", bound=Callable[..., Any])


def warn_renamed(old: str, new: str, stacklevel: int = 3) -> None:
    """Warn (FutureWarning: users see it by default) that ``old`` is spelled ``new`` now."""
    warnings.warn(
        f"{old} is deprecated and will be removed in the next release; use {new}",
        FutureWarning,
        stacklevel=stacklevel,
    )


def renamed(**names: str) -> Callable[[F], F]:
    """Accept each old keyword (with a warning) as its new one: ``@renamed(strategy="partition_strategy")``.

    Passing both spellings is a ShardvarTypeError (which one was meant is not ours to guess).
    """

    def decorate(func: F) -> F:
        qualname = getattr(func, "__qualname__", repr(func))
        init = func.__name__ == "__init__"

        @functools.wraps(func)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            for old, new in names.items():  # only a call that uses an old spelling pays more than this loop
                if old in kwargs:
                    where = type(args[0]).__name__ if init and args else qualname  # a class: Name(old=)
                    if new in kwargs:
                        raise ShardvarTypeError(f"{where}() got both {old}= (deprecated) and {new}=; pass only {new}=")
                    warn_renamed(f"{where}({old}=)", f"{new}=")
                    kwargs[new] = kwargs.pop(old)
            return func(*args, **kwargs)

        return wrapper  # type: ignore[return-value]

    return decorate


def deprecated_property(old: str, new: str, getter: Callable[[Any], Any]) -> property:
    """A read-only property ``old`` that warns and returns ``getter(self)`` (the value ``new`` gives)."""

    def get(self: Any) -> Any:
        warn_renamed(f"{type(self).__name__}.{old}", new)
        return getter(self)

    return property(get, doc=f"Deprecated: use {new}.")


def deprecated_names(module: str, names: Mapping[str, tuple[str, str]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` serving each old name (with a warning) from ``(module, name)`` where it lives now.

    >>> __getattr__ = deprecated_names(__name__, {"Old": ("shardvar.layout", "Layout")})
    """

    def __getattr__(name: str) -> Any:
        if name in names:
            home, attr = names[name]
            warn_renamed(f"{module}.{name}", f"{home}.{attr}")
            return getattr(importlib.import_module(home), attr)
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
