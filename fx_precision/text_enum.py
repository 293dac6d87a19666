"""``TextEnum``: a ``str`` enum that compares equal to, formats as and serialises to its value.

``UnitKind.ROOT == "root"``, ``f"{UnitKind.ROOT}" == "root"``, ``json.dumps(UnitKind.ROOT) == '"root"'``: the
vocabularies (node, finding, cast, parameter and unit kinds) are typed in code and read as before in reports,
JSON and command lines.
"""

from __future__ import annotations

import enum


class TextEnum(str, enum.Enum):
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)
