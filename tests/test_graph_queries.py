"""Graph queries on random valid DAGs: topological order respects every edge, parallel
groups never hold two nodes that depend on each other, the critical path is the longest chain."""

from __future__ import annotations

import re
import warnings

import networkx as nx
from hypothesis import given, settings
from hypothesis import strategies as st

from pipelines import Pipeline, TensorSpec, step
from pipelines.core.plan import DeadNodeWarning
from pipelines.core.planning import plan_of
from pipelines.examples.basic import add, diamond

V = TensorSpec("FP32", [-1])


@step(inputs={"a": V, "b": V}, outputs={"y": V})
def combine(a, b):
    return {"y": a + b}


@st.composite
def random_dags(draw):
    n = draw(st.integers(1, 12))
    p = Pipeline("rand", inputs={"x": V}, max_batch_size=4)
    refs = [p.input("x")]
    for i in range(n):
        a = draw(st.sampled_from(refs))
        b = draw(st.sampled_from(refs))
        refs.append(p.add(combine, name=f"n{i}", a=a, b=b)["y"])
    p.output("y", refs[-1])
    costs = {f"n{i}": draw(st.floats(0.0, 10.0)) for i in range(n)}
    return p, costs


@settings(max_examples=60, deadline=None)
@given(random_dags())
def test_order_groups_and_critical_path(dag):
    p, costs = dag
    g = p.graph
    order = p.topological_order()
    position = {n: i for i, n in enumerate(order)}
    assert sorted(order) == sorted(p.nodes)
    for u, v in g.edges:
        assert position[u] < position[v]
    groups = p.parallel_groups()
    assert sorted(n for grp in groups for n in grp) == sorted(p.nodes)
    for grp in groups:
        for u in grp:
            assert not (nx.descendants(g, u) & set(grp))
    path, total = p.critical_path(costs)
    assert all(g.has_edge(u, v) for u, v in zip(path, path[1:], strict=False))
    assert abs(total - sum(costs[n] for n in path)) < 1e-9
    best = max(sum(costs[n] for n in chain) for src in g for dst in g
               for chain in ([[src]] if src == dst else nx.all_simple_paths(g, src, dst)))
    assert abs(total - best) < 1e-9


def test_diagrams_show_every_step_and_wire():
    mermaid = diamond.to_mermaid()
    assert mermaid.startswith("flowchart LR")
    assert mermaid.count("-->") == 2 + 2 + 1  # input fan-out, join inputs, output
    dot = diamond.to_dot()
    assert dot.startswith('digraph "diamond"') and '"branch_0" -> "join_0"' in dot
    # names that differ only by '-', '_' or '.' are drawn as tensors of their own
    twins = Pipeline("twins", inputs={"x-1": V, "x_1": V}, max_batch_size=4)
    both = twins.add(add, a=twins.input("x-1"), b=twins.input("x_1"))
    twins.output("out-y", both["y"])
    twins.output("out.y", both["y"])
    shapes = re.findall(r"^  (\w+)\(\[", twins.to_mermaid(), re.M)
    assert len(shapes) == len(set(shapes)) == 4, twins.to_mermaid()
    assert diamond.parallel_groups() == [["branch_0", "branch_1"], ["join_0"]]
    assert diamond.critical_path({"branch_0": 20, "branch_1": 30, "join_0": 1}) == (["branch_1", "join_0"], 31.0)


@settings(max_examples=60, deadline=None)
@given(random_dags())
def test_the_plan_keeps_the_graphs_order_groups_and_critical_path_over_its_live_nodes(dag):
    p, costs = dag
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeadNodeWarning)
        plan = plan_of(p)
    g = p.graph
    out = p.outputs["y"].node
    live = nx.ancestors(g, out) | {out}
    assert set(plan.order) == live and set(plan.dropped) == set(p.nodes) - live
    assert list(plan.order) == [n for n in p.topological_order() if n in live]
    # Over the live nodes the plan's groups are the graph's generations, and its critical path the graph's.
    sub = g.subgraph(live)
    generations = [sorted(gen, key=list(p.nodes).index) for gen in nx.topological_generations(sub)]
    assert [list(grp) for grp in plan.groups] == generations
    path, total = plan.critical_path(costs)
    best = max(sum(costs[n] for n in chain) for src in sub for dst in sub
               for chain in ([[src]] if src == dst else nx.all_simple_paths(sub, src, dst)))
    assert abs(total - best) < 1e-9 and all(sub.has_edge(u, v) for u, v in zip(path, path[1:], strict=False))
    for node in plan.nodes:  # readers and last uses agree with the wiring
        for source in node.inputs:
            tensor = plan.tensor(source.key)
            assert node.name in tensor.consumers
            assert tensor.last_use is None or plan.order.index(tensor.last_use) >= plan.order.index(node.name)
