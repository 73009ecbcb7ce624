"""The dispatcher every call goes through, and the hooks that forget what was planned with
the previous one. Callers that cache plans (the attention ops, the KV-cache path, the call
plans) register a `forget` function here instead of being imported by whoever switches."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

from .dispatcher import Dispatcher, default_dispatcher

_dispatcher: Dispatcher | None = None
_forget: list[Callable[[], None]] = []


def on_dispatcher_change(forget: Callable[[], None]) -> Callable[[], None]:
    """Register `forget` (no arguments) to run whenever the dispatcher is switched; returns it,
    so it can decorate a function."""
    _forget.append(forget)
    return forget


def set_dispatcher(dispatcher: Dispatcher | None) -> None:
    """Route every call through `dispatcher` (None: back to the default registry)."""
    global _dispatcher
    _dispatcher = dispatcher
    for forget in _forget:
        forget()


def get_dispatcher() -> Dispatcher:
    """The dispatcher calls go through: the one set, else the default registry's."""
    return _dispatcher if _dispatcher is not None else default_dispatcher()


@contextlib.contextmanager
def use_dispatcher(dispatcher: Dispatcher | None) -> Iterator[Dispatcher]:
    """`set_dispatcher(dispatcher)` for a `with` block; the previous one is restored after."""
    previous = _dispatcher
    set_dispatcher(dispatcher)
    try:
        yield get_dispatcher()
    finally:
        set_dispatcher(previous)


__all__ = ["get_dispatcher", "on_dispatcher_change", "set_dispatcher", "use_dispatcher"]
