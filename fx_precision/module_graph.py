"""The module object graph of a model: paths, children, dominators, parameter homes.

A module tree is usually a tree, but a submodule may have several parents (shared blocks) and a
parameter may be held by several modules (tied embeddings)::

    root                         dominator tree            parameter homes
    ├── a ─┐                     root                      s.w   -> s     (one holder)
    │      └── s  (shared)       ├── a                     tied  -> root  (held by emb and head)
    ├── b ─┘                     ├── b
    ├── emb  (tied.w)            ├── s   <- idom(s) = root
    └── head (tied.w)            ├── emb
                                 └── head

FSDP2 claims parameters by reachability, so the plan reasons on this graph: a parameter's
*home* is the deepest module that lies on every path to every module holding it, and the wrap
order is a post-order of the object graph (every module after everything it contains).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

ROOT_NAME = "<root>"


def module_label(fqn: str) -> str:
    """How reports name a module: its FQN, or ``<root>`` for the root (FQN ``""``)."""
    return fqn if fqn else ROOT_NAME


@dataclass
class ModuleGraph:
    root: nn.Module
    first_fqn: dict[int, str] = field(default_factory=dict)
    modules: dict[int, nn.Module] = field(default_factory=dict)
    all_paths: dict[int, list[str]] = field(default_factory=dict)
    children: dict[int, list[int]] = field(default_factory=dict)
    parents: dict[int, list[int]] = field(default_factory=dict)
    idom: dict[int, int | None] = field(default_factory=dict)
    dom_children: dict[int, list[int]] = field(default_factory=dict)
    depth: dict[int, int] = field(default_factory=dict)
    post_order: list[int] = field(default_factory=list)
    by_path: dict[str, int] = field(default_factory=dict)

    @classmethod
    def of(cls, root: nn.Module) -> ModuleGraph:
        g = cls(root)
        for fqn, mod in root.named_modules(remove_duplicate=False):
            key = id(mod)
            if key not in g.modules:
                g.modules[key] = mod
                g.first_fqn[key] = fqn
                g.all_paths[key] = []
            g.all_paths[key].append(fqn)
            g.by_path[fqn] = key
        for key, mod in g.modules.items():
            kids = list(dict.fromkeys(id(child) for child in mod._modules.values() if child is not None))  # children(), deduplicated
            g.children[key] = kids
            g.parents.setdefault(key, [])
            for kid in kids:
                g.parents.setdefault(kid, []).append(key)
        g._post_order()
        g._dominators()
        return g

    def _post_order(self) -> None:
        seen: set[int] = set()
        order: list[int] = []
        stack: list[tuple[int, int]] = [(id(self.root), 0)]
        seen.add(id(self.root))
        while stack:
            key, i = stack[-1]
            kids = self.children[key]
            if i < len(kids):
                stack[-1] = (key, i + 1)
                kid = kids[i]
                if kid not in seen:
                    seen.add(kid)
                    stack.append((kid, 0))
            else:
                order.append(key)
                stack.pop()
        self.post_order = order

    def _dominators(self) -> None:
        root = id(self.root)
        self.idom = {root: None}
        self.depth = {root: 0}
        for key in reversed(self.post_order):  # reverse post-order: parents before children
            if key == root:
                continue
            parents = self.parents[key]
            dom = parents[0]
            for other in parents[1:]:
                dom = self.dom_lca(dom, other)
            self.idom[key] = dom
            self.depth[key] = self.depth[dom] + 1
        self.dom_children = {key: [] for key in self.modules}
        for key in reversed(self.post_order):
            parent = self.idom[key]
            if parent is not None:
                self.dom_children[parent].append(key)

    def dom_lca(self, a: int, b: int) -> int:
        while a != b:
            if self.depth[a] >= self.depth[b]:
                parent = self.idom[a]
                assert parent is not None
                a = parent
            else:
                parent = self.idom[b]
                assert parent is not None
                b = parent
        return a

    def dom_ancestors(self, key: int) -> list[int]:
        """``key`` and its dominators, innermost first."""
        chain = [key]
        while (parent := self.idom[chain[-1]]) is not None:
            chain.append(parent)
        return chain

    def module_paths(self) -> list[tuple[str, nn.Module]]:
        """``root.named_modules(remove_duplicate=False)``, from what ``of`` recorded (no second walk)."""
        return [(path, self.modules[key]) for path, key in self.by_path.items()]

    def buffer_names(self) -> list[str]:
        """``root.named_buffers(remove_duplicate=False)`` names, in its order."""
        return [
            f"{path}.{name}" if path else name
            for path, key in self.by_path.items()
            for name, buffer in self.modules[key]._buffers.items()
            if buffer is not None
        ]

    def nearest(self, chosen: Mapping[int, object] | set[int]) -> dict[int, int]:
        """Each module's nearest dominator in ``chosen`` (itself if chosen); the root must be chosen."""
        out: dict[int, int] = {}
        idom = self.idom
        for key in reversed(self.post_order):  # dominators before what they dominate
            out[key] = key if key in chosen else out[idom[key]]  # type: ignore[index]
        return out

    def module_at(self, path: str) -> nn.Module:
        key = self.by_path.get(path)
        return self.modules[key] if key is not None else self.root.get_submodule(path)


@dataclass
class ParamInfo:
    """One parameter object: its canonical FQN, every alias, the modules holding it, its home."""

    fqn: str
    aliases: list[str]
    param: torch.nn.Parameter
    holders: list[int]
    home: int


def collect_params(graph: ModuleGraph) -> dict[int, ParamInfo]:
    """Every parameter of the model (floating or not), keyed by ``id(param)``.

    Walks the paths ``ModuleGraph.of`` recorded, in ``named_parameters(remove_duplicate=False)``
    order, so a parameter's first alias is its canonical FQN.
    """
    infos: dict[int, ParamInfo] = {}
    for path, holder in graph.by_path.items():
        for name, param in graph.modules[holder]._parameters.items():
            if param is None:
                continue
            fqn = f"{path}.{name}" if path else name
            info = infos.get(id(param))
            if info is None:
                infos[id(param)] = ParamInfo(fqn, [fqn], param, [holder], holder)
                continue
            info.aliases.append(fqn)
            if holder not in info.holders:
                info.holders.append(holder)
                info.home = graph.dom_lca(info.home, holder)
    return infos
