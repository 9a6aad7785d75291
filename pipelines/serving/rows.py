"""Rows: requests joined into one batch and split back, and a plan's ``when`` blocks (rows
gathered to the nodes that run them, run once, scattered back with the outputs' fills).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from .datatypes import numpy_dtype


def concatenable(requests: list[Mapping[str, Any]]) -> bool:
    """Whether the requests' arrays agree on every dim but the first, so they join into one batch."""
    first = requests[0]
    return all(tuple(a[n].shape[1:]) == tuple(first[n].shape[1:]) for a in requests[1:] for n in first)


def concat_rows(arrays: list[Any]) -> Any:
    if isinstance(arrays[0], np.ndarray):
        return np.concatenate(arrays, axis=0)
    import cupy

    return cupy.concatenate(arrays, axis=0)


def split_rows(value: Any, bounds: Any) -> list[Any]:
    """``value`` cut along its first axis at ``bounds`` (views, not copies)."""
    if isinstance(value, np.ndarray):
        return np.split(value, bounds, axis=0)
    import cupy

    return cupy.split(value, [int(b) for b in bounds], axis=0)


def run_joined(
    parts: list[Mapping[str, Any]], sizes: list[int], call: Callable[[dict[str, Any], int], Mapping[str, Any]]
) -> list[dict[str, Any]] | None:
    """``call`` once on every part's rows joined (its arrays and their row count), its outputs split
    back into one dict per part by ``sizes``; ``None`` where the joined call fails, so that the
    caller runs each part alone and only the culprit fails."""
    try:
        out = call({name: concat_rows([part[name] for part in parts]) for name in parts[0]}, sum(sizes))
    except Exception:
        return None
    bounds = np.cumsum(sizes)[:-1]
    split = {name: split_rows(value, bounds) for name, value in out.items()}
    return [{name: split[name][k] for name in out} for k in range(len(parts))]


class _Skipped:
    """What a node that no row ran leaves for its outputs (see :class:`Branches`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "SKIPPED"


#: The value of every output of a node whose ``when`` held for no row: the node was not called.
SKIPPED = _Skipped()


def negated(value: Any) -> Any:
    """The answer of an output declared as ``~flag``: ``value``'s element-wise *not*.

    NumPy and CuPy alike (CuPy takes NumPy's ufuncs); :data:`SKIPPED` stays as it is, for
    the fill that follows to replace.
    """
    return value if value is SKIPPED else np.logical_not(value)


class Branches:
    """A plan's ``when`` blocks, decided once: the conditions each node runs under, which
    nodes are selects, and each output's fill. Every executor (the local runtime, the BLS
    and fused models) runs a conditional plan through it and :class:`Rows`.

    A tensor holds the rows of its producer's conditions only, in order (a pipeline input,
    every row); a node with conditions reads each input gathered to its own rows.
    """

    def __init__(self, plan: Mapping[str, Any]) -> None:
        self.when: dict[str, frozenset[tuple[Any, str, bool]]] = {
            node["name"]: frozenset((t["node"], t["tensor"], bool(t["negated"])) for t in node.get("when", ()))
            for node in plan["nodes"]
        }
        self.selects = frozenset(node["name"] for node in plan["nodes"] if node.get("kind") == "select")
        self.conditions = {
            node["name"]: [(t["node"], t["tensor"]) for t in node.get("when", ())] for node in plan["nodes"]
        }
        self.any = bool(self.selects) or any(self.when.values())
        self.fills = {out["name"]: out.get("otherwise") for out in plan["outputs"]}
        self.batched = int(plan["max_batch_size"]) > 0

    def terms_of(self, key: tuple[Any, str]) -> frozenset[tuple[Any, str, bool]]:
        """The conditions under which the tensor ``key`` (producer, name) exists."""
        return frozenset() if key[0] is None else self.when[key[0]]

    def reads(self, node: Mapping[str, Any]) -> list[tuple[Any, str]]:
        """Every tensor a node of the plan (its JSON) reads once: its inputs, then its conditions."""
        return [(s["node"], s["tensor"]) for s in node["inputs"]] + self.conditions[node["name"]]


_ALL = object()  # Rows' mask for the rows of no condition: every row


class Rows:
    """One run's rows (one request, or requests joined into one batch) against a plan's
    :class:`Branches`: which rows each set of conditions selects, and the gathers and
    scatters between them. ``read(key)`` gives a condition tensor as a host array; each
    condition is read once, when a node first needs it, so it may be released after that.
    """

    def __init__(self, branches: Branches, rows: int | None, read: Callable[[Any], Any]) -> None:
        self.branches = branches
        self.n = int(rows or 1) if branches.batched else 1
        self._read = read
        self._masks: dict[Any, Any] = {frozenset(): _ALL}
        self._terms: dict[Any, np.ndarray] = {}

    def mask(self, terms: frozenset) -> Any:
        """The rows where every condition of ``terms`` holds: a bool array, or ``_ALL``."""
        found = self._masks.get(terms)
        if found is None:
            found = np.ones(self.n, dtype=bool)
            for term in terms:
                found &= self._term(term)
            self._masks[terms] = found
        return found

    def _term(self, term: tuple[Any, str, bool]) -> np.ndarray:
        found = self._terms.get(term)
        if found is None:
            node, tensor, negated = term
            values = np.asarray(_on_host(self._read((node, tensor))), dtype=bool).reshape(-1)
            where = self.mask(self.branches.terms_of((node, tensor)))
            found = np.zeros(self.n, dtype=bool)
            # A row outside the condition's own rows holds neither it nor its negation.
            found[slice(None) if where is _ALL else where] = ~values if negated else values
            self._terms[term] = found
        return found

    def count(self, terms: frozenset) -> int:
        """How many rows run under ``terms``."""
        mask = self.mask(terms)
        return self.n if mask is _ALL else int(mask.sum())

    def read_conditions(self, node: str) -> None:
        """Work out ``node``'s rows now, while its conditions are still held."""
        self.mask(self.branches.when[node])

    def rows_of(self, node: str) -> int:
        """How many rows ``node`` runs on (0: its `when` blocks hold for none), worked out now."""
        self.read_conditions(node)
        return self.count(self.branches.when[node])

    def settle(
        self, node: Mapping[str, Any], returns: Iterable[str], value_of: Callable[[Any, str], Any]
    ) -> dict[str, Any] | None:
        """What a node of the plan (its JSON) leaves without a call, or ``None`` where its step
        must run (on :meth:`count` of its rows): a select's output merged here (its inputs read
        as in :meth:`merge_select`), or, where no row holds its conditions, each output it
        ``returns`` as :data:`SKIPPED`. Once it is settled, its :meth:`Branches.reads` are spent.
        """
        name = node["name"]
        rows = self.rows_of(name)
        if rows and name not in self.branches.selects:
            return None
        if rows:
            return {"output": self.merge_select(node, value_of)}
        return dict.fromkeys(returns, SKIPPED)

    def gather(self, value: Any, source: frozenset, terms: frozenset) -> Any:
        """``value``, which holds the rows of ``source``, cut to the rows of ``terms`` (a subset of them)."""
        if source == terms or not self.branches.batched:
            return value
        inner, outer = self.mask(terms), self.mask(source)
        positions = np.flatnonzero(inner if outer is _ALL else inner[outer])
        if len(positions) == len(value):
            return value
        return value[_index_for(value, positions)]

    def merge_select(self, node: Mapping[str, Any], value_of: Callable[[Any, str], Any]) -> Any:
        """A select node of the plan (its JSON) merged from its inputs, each read as
        ``value_of(key, dtype)``: what every executor of a conditional plan does the same way."""
        bound = {s["input"]: s for s in node["inputs"]}
        sources: dict[str, tuple[Any, Any]] = {
            "condition": ((bound["condition"]["node"], bound["condition"]["tensor"]), None)
        }
        for side in ("then", "otherwise"):
            key = (bound[side]["node"], bound[side]["tensor"])
            sources[side] = (value_of(key, bound[side]["dtype"]), self.branches.terms_of(key))
        return self.merge(node["name"], sources)

    def merge(self, node: str, sources: Mapping[str, tuple[Any, frozenset]]) -> Any:
        """A select node's output: ``then``'s rows where its condition holds, ``otherwise``'s elsewhere.

        ``sources`` maps ``"condition"``, ``"then"`` and ``"otherwise"`` to (value, the
        conditions of its producer); the condition's value is read through ``read``.
        """
        terms = self.branches.when[node]
        (ckey, _), (then, then_terms), (other, other_terms) = (
            sources["condition"], sources["then"], sources["otherwise"]
        )
        holds, fails = terms | {(*ckey, False)}, terms | {(*ckey, True)}
        if not self.branches.batched:
            return then if self.count(holds) else other
        outer = self.mask(terms)
        parts = []
        for value, value_terms, rows in ((then, then_terms, holds), (other, other_terms, fails)):
            if self.count(rows):
                inner = self.mask(rows)
                positions = np.flatnonzero(inner if outer is _ALL else inner[outer])
                parts.append((positions, _on_host(self.gather(value, value_terms, rows))))
        first = parts[0][1]
        merged = np.empty((self.count(terms), *first.shape[1:]), dtype=first.dtype)
        for positions, value in parts:
            merged[positions] = value
        return merged

    def filled(self, value: Any, source: frozenset, fill: Mapping[str, Any] | None) -> Any:
        """An output that holds the rows of ``source``, with ``fill`` in every other row."""
        if not source:
            return value
        mask = self.mask(source)
        k = self.count(source)
        if not self.branches.batched:
            return value if k else _fill_array(fill, None)
        if k == self.n:
            return value
        if value is SKIPPED:
            return _fill_array(fill, self.n)
        value = _on_host(value)
        out = np.empty((self.n, *value.shape[1:]), dtype=value.dtype)
        out[...] = _fill_values(fill, value.dtype)
        out[mask] = value
        return out


def _fill_values(fill: Mapping[str, Any], dtype: Any = None) -> np.ndarray:
    """A plan's fill (``pipelines.core.plan.Fill`` as JSON) as an array of its own shape."""
    if fill["dtype"] == "BYTES":
        values = np.empty(len(fill["data"]), dtype=object)
        values[:] = [text.encode("latin-1") for text in fill["data"]]
    else:
        values = np.asarray(fill["data"], dtype=dtype if dtype is not None else numpy_dtype(fill["dtype"]))
    return values.reshape(fill["shape"])


def _fill_array(fill: Mapping[str, Any], rows: int | None) -> np.ndarray:
    """Every row filled: ``rows`` of the output's dims (a ``-1`` dim, no row ran it: size 0)."""
    body = tuple(0 if d == -1 else d for d in fill["dims"])
    values = _fill_values(fill)
    out = np.empty(body if rows is None else (rows, *body), dtype=values.dtype)
    out[...] = values
    return out


def _on_host(value: Any) -> Any:
    """A CuPy array copied to the host (a mask or a scatter works on numpy); numpy as it is."""
    if isinstance(value, np.ndarray) or not hasattr(value, "get"):
        return value
    return value.get()


def _index_for(value: Any, positions: np.ndarray) -> Any:
    """``positions`` in the array module of ``value`` (CuPy indexes with CuPy arrays)."""
    if isinstance(value, np.ndarray) or not hasattr(value, "__cuda_array_interface__"):
        return positions
    import cupy

    return cupy.asarray(positions)
