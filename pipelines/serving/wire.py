"""The error wire format: what a model tells the client about a failure, and how a step's own
exception is told (its reason and the line of the step's code that raised it).
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .checks import check_names
from .sources import SOURCE_DIR


@dataclass(frozen=True)
class WireError:
    """What a model tells the client about a failure, in the text of its error response.

    ``kind`` is the library's error class name (``InputError``, ``StepError``…);
    ``node`` is the name the user gave in the pipeline, ``step`` the step's own.
    """

    kind: str
    pipeline: str
    reason: str
    node: str | None = None
    step: str | None = None
    tensor: str | None = None

    def text(self) -> str:
        """``StepError in pipeline 'p', node 'n', step 's', tensor 't': reason`` (absent parts left out)."""
        where = f"{self.kind} in pipeline {self.pipeline!r}"
        for label, value in (("node", self.node), ("step", self.step), ("tensor", self.tensor)):
            if value is not None:
                where += f", {label} {value!r}"
        return f"{where}: {self.reason}"


# Names follow Triton's rules (pipelines.core.names), so they never hold a quote.
_WIRE = re.compile(
    r"(?P<kind>[A-Z][A-Za-z]*Error) in pipeline '(?P<pipeline>[^']*)'"
    r"(?:, node '(?P<node>[^']*)')?(?:, step '(?P<step>[^']*)')?(?:, tensor '(?P<tensor>[^']*)')?: (?P<reason>.*)",
    re.S,
)


def parse_error(text: str) -> WireError | None:
    """The :class:`WireError` in a server's error text (Triton may add words before it), or ``None``."""
    found = _WIRE.search(text)
    if found is None:
        return None
    return WireError(**found.groupdict())


def request_tensors(request: Any, specs: Mapping[str, Any]) -> dict[str, Any]:
    """A pb request's input tensors by name; ``Refused`` names a missing or undeclared one."""
    given = {t.name(): t for t in request.inputs()}
    if len(given) != len(specs) or any(n not in given for n in specs):
        check_names(list(given), specs)
    return given


def unknown_output(asked: list[str], outputs: Any, pipeline: str) -> WireError | None:
    """The error for a request that asks for an output the pipeline does not have, if it does."""
    unknown = [n for n in asked if n not in outputs]
    if not unknown:
        return None
    reason = f"output {unknown[0]!r} was requested but the pipeline has outputs {list(outputs)}"
    return WireError("InputError", pipeline, reason, tensor=unknown[0])


def called_model_error(message: str, pipeline: str, node: str, step: str, model: str) -> WireError:
    """A called composing model's error response, said again with the node that called it."""
    said = parse_error(message) or WireError("StepError", pipeline, f"failed (model {model!r}): {message}")
    return WireError(said.kind, pipeline, said.reason, node, step, said.tensor)


def exception_reason(exc: BaseException, home: str | None = None, shown: str | None = None) -> str:
    """How a step's own exception is told: ``raised ValueError: what it said (at steps.py:42)``.

    The place is the last line of the traceback in the step's own file (``home``), else in
    any file that is neither this package's nor Python's or an installed library's: the same
    words in every form and locally, since a step's code keeps its file name wherever it runs.
    """
    where = raised_at(exc, home, shown)
    return f"raised {type(exc).__name__}: {exc}" + (f" (at {where})" if where else "")


def raised_at(exc: BaseException, home: str | None = None, shown: str | None = None) -> str | None:
    """``file.py:line`` where a step's code raised ``exc`` (see :func:`exception_reason`), or ``None``.

    ``shown`` names ``home`` where its own name says nothing: a step that travelled by value
    has cloudpickle's ``<dynamic-code>`` for a file, and its ``step.json`` keeps the real name
    (a step that travelled as its source file keeps its file's name).
    """
    given = getattr(exc, "_step_location", None)  # worked out where it was raised (another process)
    if isinstance(given, str):
        return given
    ours, theirs = None, None
    tb = exc.__traceback__
    while tb is not None:
        filename = tb.tb_frame.f_code.co_filename
        if home is not None and filename == home:
            ours = f"{shown or _basename(filename)}:{tb.tb_lineno}"
        elif _users_file(filename):
            theirs = f"{_basename(filename)}:{tb.tb_lineno}"
        tb = tb.tb_next
    return ours or theirs


def code_home(impl: Any) -> str | None:
    """The file a step's code lives in: its function's, or its class's ``execute``/``__call__``."""
    target = impl
    if inspect.isclass(impl):
        target = getattr(impl, "execute", None) or getattr(impl, "__call__", None)  # noqa: B004 - the method itself
    target = inspect.unwrap(target) if callable(target) else target
    code = getattr(target, "__code__", None)
    return code.co_filename if code is not None else None


def _basename(filename: str) -> str:
    return filename.replace("\\", "/").rsplit("/", 1)[-1]


# The folder above this package: ``pipelines``, or the model's version folder on a server.
_HERE = __file__.rsplit("/", 2)[0] + "/"


def _users_file(filename: str) -> bool:
    if filename.startswith("<"):
        return False
    if filename.startswith(_HERE):
        # On a server, the step's own files copied beside the model are the user's; the rest is ours.
        return f"/{SOURCE_DIR}/" in filename[len(_HERE) - 1 :]
    return not any(part in filename for part in ("/site-packages/", "/dist-packages/", "/lib/python3"))
