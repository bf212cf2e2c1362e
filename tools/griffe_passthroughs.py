"""A griffe extension for the API page (mkdocs.yml): two kinds of member are read as what
they are, not as attributes with no docstring.

The members `TorchMemorySaver` serves from `saver` as they are there (compat.py's
`_Method(MemorySaver.name)` and `_Setting()`) are read as a pointer to `MemorySaver`'s member;
and `MemorySaver`'s options (options.py's `SaverOption[T](doc)`, one per
row of the options table) are read with the documentation their descriptor is given."""

from __future__ import annotations

import ast
import inspect
import re
from typing import Any

import griffe

PASSTHROUGH = re.compile(r"^_(Method\(MemorySaver\.\w+\)|Setting(\[.*\])?\(\))$")


OPTION = re.compile(r"^SaverOption(\[.*\])?\(")


def option_doc(node: Any) -> str | None:
    """The documentation a `SaverOption[T]("...")` assignment hands its descriptor, else None."""
    value = getattr(node, "value", None)
    if isinstance(value, ast.Call) and value.args and isinstance(value.args[0], ast.Constant):
        text = value.args[0].value
        return inspect.cleandoc(text) if isinstance(text, str) else None
    return None


class SavedMembers(griffe.Extension):
    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        if attr.parent is not None and attr.parent.name == "MemorySaver" and attr.value is not None \
                and OPTION.match(str(attr.value)):
            doc = option_doc(node)
            if doc is not None:
                attr.docstring = griffe.Docstring(doc, parent=attr)
                typed = OPTION.match(str(attr.value))
                if typed and typed.group(1):
                    attr.annotation = typed.group(1)[1:-1]  # SaverOption[bool]: a bool
                attr.value = None  # the descriptor is how, not what
                attr.labels = {"option"}
            return
        if attr.parent is None or attr.parent.name != "TorchMemorySaver" or attr.docstring is not None:
            return
        if attr.value is not None and PASSTHROUGH.match(str(attr.value)):
            target = f"torch_mem_saver_lite.MemorySaver.{attr.name}"
            attr.docstring = griffe.Docstring(f"`saver`'s, served as it is there: see [`MemorySaver.{attr.name}`]"
                                              f"[{target}].", parent=attr)
            attr.value = None  # the descriptor is how, not what
            attr.labels = {"from saver"}  # not the class or instance attribute griffe would call it
