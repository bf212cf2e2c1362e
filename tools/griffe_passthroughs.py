"""A griffe extension for the API page (mkdocs.yml): the members `TorchMemorySaver` serves
from `saver` as they are there (compat.py's `_Method(MemorySaver.name)` and `_Setting()`)
are read as what they are, a pointer to `MemorySaver`'s member, not as attributes with no
docstring."""

from __future__ import annotations

import re
from typing import Any

import griffe

PASSTHROUGH = re.compile(r"^_(Method\(MemorySaver\.\w+\)|Setting(\[.*\])?\(\))$")


class SavedMembers(griffe.Extension):
    def on_attribute_instance(self, *, node: Any, attr: griffe.Attribute, agent: Any, **kwargs: Any) -> None:
        if attr.parent is None or attr.parent.name != "TorchMemorySaver" or attr.docstring is not None:
            return
        if attr.value is not None and PASSTHROUGH.match(str(attr.value)):
            target = f"torch_mem_saver_lite.MemorySaver.{attr.name}"
            attr.docstring = griffe.Docstring(f"`saver`'s, served as it is there: see [`MemorySaver.{attr.name}`]"
                                              f"[{target}].", parent=attr)
            attr.value = None  # the descriptor is how, not what
            attr.labels = {"from saver"}  # not the class or instance attribute griffe would call it
