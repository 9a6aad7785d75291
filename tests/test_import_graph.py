"""No import circle among the package's modules (issue 62): every import counts, at the top of a
module, inside a function and under ``TYPE_CHECKING``. grimp (import-linter's engine) reads
every import statement of every module; a circle is a strongly connected set of them.

And the user's ``Pipeline`` sits at the top, over the core's ``Graph``, which knows nothing of it."""

from __future__ import annotations

import sys
import textwrap

import grimp
import networkx as nx


def import_graph(package: str) -> tuple[nx.DiGraph, grimp.ImportGraph]:
    found = grimp.build_graph(package, cache_dir=None)
    graph = nx.DiGraph()
    graph.add_nodes_from(found.modules)
    for module in found.modules:
        for imported in found.find_modules_directly_imported_by(module):
            graph.add_edge(module, imported)
    return graph, found


def import_circles(package: str) -> list[str]:
    """Each circle of imports among ``package``'s modules, with the lines that make it."""
    graph, found = import_graph(package)
    said = []
    for members in nx.strongly_connected_components(graph):
        if len(members) == 1 and not graph.has_edge(*members, *members):
            continue
        lines = []
        for importer, imported in sorted(graph.subgraph(members).edges):
            for detail in found.get_import_details(importer=importer, imported=imported):
                lines.append(f"    {importer} -> {imported} (line {detail['line_number']}: "
                             f"{detail['line_contents'].strip()})")
        said.append(f"{len(members)} modules: {', '.join(sorted(members))}\n" + "\n".join(lines))
    return said


def test_no_module_of_the_package_imports_itself_round_a_circle():
    circles = import_circles("pipelines")
    assert not circles, (
        f"{len(circles)} import circle(s) among the modules of pipelines; break each (a lower module must "
        "not import a higher one, even lazily or under TYPE_CHECKING):\n" + "\n".join(circles)
    )


def test_a_lazy_or_type_checking_import_makes_a_circle_too(tmp_path, monkeypatch):
    # a imports b at the top; b imports c inside a function; c imports a only for its annotations.
    package = tmp_path / "circled"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from . import b\n")
    (package / "b.py").write_text("def later():\n    from . import c\n\n    return c\n")
    (package / "c.py").write_text(textwrap.dedent("""
        from __future__ import annotations

        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            from .a import b
    """))
    (package / "d.py").write_text("from . import a\n")  # imports into the circle, is not in it
    monkeypatch.syspath_prepend(str(tmp_path))
    circles = import_circles("circled")
    assert len(circles) == 1, circles
    assert circles[0].startswith("3 modules: circled.a, circled.b, circled.c\n"), circles[0]
    assert "circled.b -> circled.c (line 2: from . import c)" in circles[0]
    assert "circled.c -> circled.a (line 7: from .a import b)" in circles[0]
    sys.modules.pop("circled", None)


def test_pipeline_is_the_users_class_over_the_cores_graph():
    import pipelines
    from pipelines import Pipeline, predict
    from pipelines.core.graph import Graph
    from pipelines.measured_prediction import predict as predict_function
    from pipelines.pipeline import Pipeline as TopPipeline

    assert Pipeline is TopPipeline and issubclass(Pipeline, Graph)
    assert not any(hasattr(Graph, name) for name in ("compile", "run", "stream", "predict", "advise", "diagram"))
    # Pipeline imports the package pipelines.predict, whose name must not hide the function.
    assert predict is predict_function and pipelines.predict is predict_function
    graph, _ = import_graph("pipelines")
    # Nothing below the top imports the user's class: the core and the layers read a Graph.
    assert set(graph.predecessors("pipelines.pipeline")) <= {"pipelines", "pipelines.cli", "pipelines.__main__"} | {
        m for m in graph if m.startswith("pipelines.examples.")
    }
    assert not {m for m in nx.descendants(graph, "pipelines.core.graph") if m.split(".")[1] in
                {"compile", "runtime", "predict", "calibration", "bench", "endpoint", "triton", "pipeline"}}
