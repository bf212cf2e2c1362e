"""A saver's switches as attributes, from the one options table (csrc/platform/options.h).

The table is the native library's: each row names a switch, the kind of its value, where it
may be set (a saver, a tag, the node), its environment variables and defaults. Here each
switch a user sets on the saver is one ``SaverOption`` descriptor on ``MemorySaver``, with its
documentation; its value travels to the core as text in the grammar of its kind, and reading
it asks the core (or, before the core exists, the value set or the process default the
environment gave). Nothing here keeps a copy of a value the core holds.

Setting or reading an option never starts the CUDA driver: until the core exists, what a
program sets is kept (``SaverOptions``) and handed over once when the core is made.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any, Generic, TypeVar, cast

from . import _lib
from .settings import check_bool, check_bytes
from .stray_access import check_mode

T = TypeVar("T")

# Per kind: the Python value checked (TypeError/ValueError naming the option), as the text the
# core takes, and the text the core gives as the Python value.
_CHECKS: dict[str, Callable[[object, str], Any]] = {
    "flag": check_bool,
    "size": check_bytes,
    "stray": lambda value, name: (check_mode(value, name), value)[1],
}
_TO_TEXT: dict[str, Callable[[Any], str]] = {"flag": lambda v: "1" if v else "0", "size": str, "stray": str}
_FROM_TEXT: dict[str, Callable[[str], Any]] = {"flag": lambda t: t == "1", "size": int, "stray": str}


def _row(name: str) -> _lib.OptionRow:
    return _lib.option_table()[name]


def check(name: str, value: object) -> str:
    """``value`` for the option ``name`` as the text the core takes, or TypeError/ValueError
    naming the option and what it takes."""
    kind = _row(name).kind
    return _TO_TEXT[kind](_CHECKS[kind](value, name))


def value_of(name: str, text: str) -> Any:
    """The core's text for the option ``name`` as its Python value."""
    return _FROM_TEXT[_row(name).kind](text)


class SaverOptions:
    """The options of one saver: set on its core at once where the core exists, else kept
    (as text, checked) and handed to the core when it is made."""

    def __init__(self, core: Callable[..., _lib.NativeSaver | None], environment: Callable[[], object]) -> None:
        self._core = core
        # Reads the environment once (raising MemorySaverError for a bad variable), before a
        # process default is taken as the value.
        self._environment = environment
        self._lock = threading.Lock()
        self._pending: dict[str, str] = {}  # set before the core existed, in the order set

    def get(self, name: str) -> Any:
        native = self._core(create=False)
        if native is not None:
            return value_of(name, native.option(name))
        with self._lock:
            text = self._pending.get(name)
        if text is None:
            self._environment()
            text = _lib.process_option(name)
        return value_of(name, text)

    def set(self, name: str, value: object) -> None:
        text = check(name, value)
        native = self._core(create=False)
        if native is None:
            with self._lock:
                self._pending.pop(name, None)
                self._pending[name] = text
            # A core made meanwhile may have taken the pending values before this one: it is
            # given this one too (setting it twice is harmless).
            native = self._core(create=False)
            if native is None:
                return
        native.set_option(name, text)

    def apply(self, native: _lib.NativeSaver) -> None:
        """Give a new core what was set before it existed."""
        with self._lock:
            pending = list(self._pending.items())
        for name, text in pending:
            native.set_option(name, text)


class SaverOption(Generic[T]):
    """One switch of the options table as an attribute of ``MemorySaver`` (its name is the
    table's), documented here; its value is the core's (``SaverOptions``)."""

    def __init__(self, doc: str) -> None:
        self.__doc__ = doc
        self.name = ""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, saver: Any, owner: type | None = None) -> T:
        if saver is None:
            return cast(T, self)
        return cast(T, saver._options.get(self.name))

    def __set__(self, saver: Any, value: T) -> None:
        saver._options.set(self.name, value)


def tag_texts(values: Mapping[str, object]) -> dict[str, str]:
    """A region's own values for its tag (options of the tag scope; None: not given) as the
    texts the core takes, each checked (TypeError/ValueError naming it) before any is set."""
    return {name: check(name, value) for name, value in values.items() if value is not None}


def set_tag_options(native: _lib.NativeSaver, tag: str, texts: Mapping[str, str]) -> None:
    """Sets the tag's own values (``tag_texts``) on the core."""
    for name, text in texts.items():
        native.set_option(name, text, tag=tag)
