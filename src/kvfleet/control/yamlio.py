"""YAML output of manifests and CRDs: no anchors/aliases (every object stands alone, as
``kubectl`` users expect), keys in insertion order, multi-line strings (scripts) as ``|`` blocks."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import yaml


class _Dumper(yaml.SafeDumper):
    def ignore_aliases(self, data: Any) -> bool:
        return True


def _str(dumper: yaml.SafeDumper, data: str) -> yaml.ScalarNode:
    block = "\n" in data and all(line == line.rstrip() for line in data.split("\n"))
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style="|" if block else None)


_Dumper.add_representer(str, _str)


def dump(obj: Any, width: int = 120) -> str:
    """One YAML document."""
    return yaml.dump(obj, Dumper=_Dumper, sort_keys=False, width=width, allow_unicode=True)


def dump_all(objs: Iterable[Any], width: int = 1000) -> str:
    """Multi-document YAML, each document starting with ``---``."""
    return "".join("---\n" + dump(o, width) for o in objs)
