"""The core: tensors, steps, the graph a pipeline declares and its checks, and the execution plan.

It knows nothing of what a graph is compiled to or run on (pipelines.pipeline.Pipeline does)."""
