"""What runs when a step's file is imported, read from its syntax tree without running it: the
modules it imports (and whether each is required), what it asks of ``pipelines`` (only the public
names of ``pipelines`` and ``pipelines.steps``, which a server stands in for), and the work it
does (compiling or running a pipeline, reading ``sys.argv``), which a server would do again.
:mod:`.step_sources` decides by it whether a step's file can travel.
"""

from __future__ import annotations

import ast
import sys
import types
from collections.abc import Mapping
from typing import Any

__all__ = ["HELPERS", "PACKAGE", "TopLevel", "is_ours", "public_names"]

#: The package a step's file may import only the public names of.
PACKAGE = "pipelines"


def is_ours(name: object) -> bool:
    """Whether ``name`` is ``pipelines`` or one of its modules."""
    return isinstance(name, str) and (name == PACKAGE or name.startswith(PACKAGE + "."))


#: The library's helpers for declaring steps: a file may import their public names, as it may
#: ``pipelines``' own, and a server stands in for them (``serving/sources.py``).
HELPERS = PACKAGE + ".steps"


def public_names(module_name: str) -> frozenset[str] | None:
    """The names a step's file may import from ``module_name`` (``pipelines``, ``pipelines.steps``
    or one of its public modules), for a server to stand in for; ``None``: none, it is internal."""
    if module_name != PACKAGE and module_name != HELPERS and not (
        module_name.startswith(HELPERS + ".") and not module_name.rpartition(".")[2].startswith("_")
    ):
        return None
    module = sys.modules.get(module_name)
    if module is None:
        return None
    exported = getattr(module, "__all__", None)
    names = exported if exported is not None else [n for n in vars(module) if not n.startswith("_")]
    return frozenset(names)


#: What a script does rather than declares: run on import, it would run again in every stub.
_WORK = frozenset({"compile", "compile_pipeline", "write", "run", "serve", "bench", "predict", "advise", "compare",
                   "calibrate"})


class TopLevel(ast.NodeVisitor):
    """What runs when a file is imported: its imports (and whether each is required), what it
    asks of ``pipelines``, and the work it does (``work``: compiling or running a pipeline,
    reading ``sys.argv``). Function bodies and the ``__main__`` block do not run then.

    ``scope``, the globals of the file as imported here, tells a pipeline from other objects.
    """

    def __init__(self, filename: str, scope: Mapping[str, Any]) -> None:
        self.filename = filename
        self.scope = scope
        self.imports: list[tuple[str, bool]] = []
        self.problem: str | None = None
        self.work: list[str] = []
        self._optional = 0
        self._aliases: dict[str, str] = {}  # a name the file binds to a module of pipelines: that module

    def visit_Call(self, node: ast.Call) -> None:
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else None
        if name == "parse_args" or (name in _WORK and self._pipelines_object(func)):
            self.work.append(f"{ast.unparse(func)}(...) at line {node.lineno}")
        self.generic_visit(node)

    def _pipelines_object(self, expr: ast.expr) -> bool:
        while isinstance(expr, (ast.Attribute, ast.Call, ast.Subscript)):
            expr = expr.func if isinstance(expr, ast.Call) else expr.value
        if not isinstance(expr, ast.Name):
            return False
        if expr.id in self._aliases:
            return True
        value = self.scope.get(expr.id)
        if value is None:
            return False
        if isinstance(value, types.ModuleType):
            return is_ours(value.__name__)
        return is_ours(value.__module__ if isinstance(value, (type, types.FunctionType)) else type(value).__module__)

    def _refuse(self, what: str) -> None:
        self.problem = self.problem or (f"{self.filename} {what}; on a server, where pipelines need not be, "
                                        "only the public names of pipelines and pipelines.steps "
                                        "(`from pipelines import ...`, `from pipelines.steps import ...`) "
                                        "are stood in for")

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            top = alias.name.partition(".")[0]
            if top == PACKAGE:
                if public_names(alias.name) is None:
                    self._refuse(f"imports {alias.name}")
                # `import pipelines.steps` binds `pipelines`; `import pipelines.steps as s`, the module.
                self._aliases[alias.asname or PACKAGE] = alias.name if alias.asname else PACKAGE
            self.imports.append((top, not self._optional))

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            self.problem = self.problem or f"{self.filename} has a relative import (from {'.' * node.level})"
            return
        top = (node.module or "").partition(".")[0]
        if node.module == "sys" and any(alias.name == "argv" for alias in node.names):
            self.work.append(f"sys.argv at line {node.lineno}")
        if top == PACKAGE:
            public = public_names(node.module or "")
            if public is None:
                self._refuse(f"imports from {node.module}")
            else:
                for alias in node.names:
                    if alias.name not in public and public_names(f"{node.module}.{alias.name}") is None:
                        self._refuse(f"imports {alias.name!r} from {node.module}")
        self.imports.append((top, not self._optional))

    def visit_Attribute(self, node: ast.Attribute) -> None:
        if isinstance(node.value, ast.Name) and node.value.id == "sys" and node.attr == "argv":
            self.work.append(f"sys.argv at line {node.lineno}")
        chain = _dotted(node)
        if chain is not None and chain[0] in self._aliases:
            # The longest public module the chain names, then one public name of it.
            module, rest = self._aliases[chain[0]], list(chain[1:])
            while rest and public_names(f"{module}.{rest[0]}") is not None:
                module = f"{module}.{rest.pop(0)}"
            if rest and rest[0] not in (public_names(module) or ()):
                self._refuse(f"uses {module}.{rest[0]}")
            return
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        if _is_main_guard(node.test) or _is_type_checking(node.test):
            for stmt in node.orelse:
                self.visit(stmt)
            return
        self.generic_visit(node)

    def visit_Try(self, node: ast.Try) -> None:
        optional = any(_catches_import_errors(h) for h in node.handlers)
        self._optional += optional
        for stmt in node.body:
            self.visit(stmt)
        self._optional -= optional
        self._optional += 1  # a fallback, run only when the body failed
        for handler in node.handlers:
            self.visit(handler)
        self._optional -= 1
        for stmt in [*node.orelse, *node.finalbody]:
            self.visit(stmt)

    visit_TryStar = visit_Try

    def _definition(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        # Decorators, defaults and annotations run when the function is defined; the body does not.
        for expr in [*getattr(node, "decorator_list", ()), *node.args.defaults,
                     *(d for d in node.args.kw_defaults if d is not None)]:
            self.visit(expr)

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _definition


def _dotted(node: ast.expr) -> tuple[str, ...] | None:
    """``a.b.c`` as ``("a", "b", "c")``; ``None`` for anything but names and attributes."""
    parts: list[str] = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return (node.id, *reversed(parts)) if isinstance(node, ast.Name) else None


def _is_main_guard(test: ast.expr) -> bool:
    if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)):
        return False
    sides = [test.left, test.comparators[0]]
    return (any(isinstance(s, ast.Name) and s.id == "__name__" for s in sides)
            and any(isinstance(s, ast.Constant) and s.value == "__main__" for s in sides))


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _catches_import_errors(handler: ast.ExceptHandler) -> bool:
    if handler.type is None:
        return True
    names = handler.type.elts if isinstance(handler.type, ast.Tuple) else [handler.type]
    return any(isinstance(n, ast.Name) and n.id in ("ImportError", "ModuleNotFoundError", "Exception",
                                                    "BaseException") for n in names)
