"""Triton Python-backend gate: the last step of an ensemble whose steps carry failures as data.

Copied verbatim as ``<ensemble>__gate/1/model.py``, with the ``serving/`` package beside it. It reads
``gate.json`` beside it. Each
request brings the pipeline's outputs and one UINT8 ``__err__`` tensor per Python step
(``serving.failure_tensor``). The
gate runs after every other step of the request, so it is the one place where an error
response cannot race a sibling step (Triton 2.51 crashes when one does). It answers with
the outputs (an output declared as ``~flag`` negated), or with the first failure in
topological order, naming the node as the user named it.
"""

from __future__ import annotations

try:  # in a repository: the copy beside this file (the stub imports this file as "<version>.model")
    from . import serving
except ImportError:  # in the package, for tests and linters
    from pipelines import serving

pb_utils = serving.pb_utils  # Triton's triton_python_backend_utils in a stub; None elsewhere


class TritonPythonModel:
    def initialize(self, args):
        _, plan = serving.model_plan(args, "gate.json")
        self.pipeline = plan["pipeline"]
        self.outputs = plan["outputs"]
        self.errors = plan["errors"]
        serving.refuse_strings_under_numpy_2(
            args.get("model_name", self.pipeline), [n for n, out in self.outputs.items() if out["dtype"] == "BYTES"]
        )

    def execute(self, requests):
        return [self._answer(request) for request in requests]

    def _answer(self, request):
        for entry in self.errors:
            tensor = pb_utils.get_input_tensor_by_name(request, entry["input"])
            if tensor is None:
                continue
            text = serving.failure_text(tensor)
            if text is not None:
                # The first in topological order is where the failure began: a step that did not run
                # because of it comes later and passes its text on. The gate knows which node that was.
                said = serving.parse_error(text)
                if said is None:
                    reason = f"failed (model {entry['model']!r}): {text}"
                    said = serving.WireError("StepError", self.pipeline, reason)
                # A failure a streaming step passed on names the node it began in; others name no node or this one.
                node = said.node or entry["node"]
                error = serving.WireError(said.kind, self.pipeline, said.reason, node, said.step, said.tensor)
                return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error.text()))
        wanted = list(request.requested_output_names() or ()) or list(self.outputs)
        tensors = []
        for name in wanted:
            out = self.outputs[name]
            tensor = pb_utils.get_input_tensor_by_name(request, out["input"])
            if out.get("negated"):  # an output declared as ~flag: the gate is the ensemble's one place to negate
                tensors.append(pb_utils.Tensor(name, serving.negated(tensor.as_numpy())))
            elif out["dtype"] == "BYTES":  # DLPack has no string tensors
                tensors.append(pb_utils.Tensor(name, tensor.as_numpy()))
            else:
                tensors.append(pb_utils.Tensor.from_dlpack(name, tensor.to_dlpack()))
        return pb_utils.InferenceResponse(output_tensors=tensors)
