"""Triton Python-backend model that stands in for an ``onnxruntime`` model on the bundled server,
which has only the Python backend: it runs the model's ONNX file with onnxruntime.

Copied verbatim as ``<model>/<version>/model.py`` into the repository the bundled server is given
(``pipelines/triton/stand_ins.py``), with the ``serving/`` package and a link to the ONNX file
beside it. Its config is the model's own, with ``backend: "python"`` and the parameters below,
which say what it is. It answers a list of requests with one run over their rows when the model
batches, and one run per request when that run fails, so one bad request fails alone.
"""

from __future__ import annotations

import json
import os

try:  # in a repository: the copy beside this file (the stub imports this file as "<version>.model")
    from . import serving
except ImportError:  # in the package, for tests and linters
    from pipelines import serving

pb_utils = serving.pb_utils  # Triton's triton_python_backend_utils in a stub; None elsewhere

#: The config parameter that labels the model a stand-in, and says for what.
STAND_IN_PARAMETER = "pipelines_stand_in"
#: The config parameter naming the ONNX file in the version folder.
ONNX_FILE_PARAMETER = "pipelines_onnx_file"
#: The onnxruntime backend's own thread parameters, honoured here too.
THREAD_PARAMETERS = ("intra_op_thread_count", "inter_op_thread_count")


class TritonPythonModel:
    def initialize(self, args):
        config = json.loads(args["model_config"])
        self.name = args.get("model_name", config.get("name", "model"))
        parameters = {k: v.get("string_value", "") for k, v in (config.get("parameters") or {}).items()}
        self.max_batch_size = int(config.get("max_batch_size", 0))
        what = f"the onnxruntime stand-in of model {self.name!r}"
        inputs, outputs = serving.config_specs(config, what)
        serving.refuse_strings_under_numpy_2(
            self.name, [n for n, spec in {**inputs, **outputs}.items() if spec.dtype == "BYTES"]
        )
        path = os.path.join(args["model_repository"], str(args["model_version"]), parameters[ONNX_FILE_PARAMETER])
        intra, inter = (int(parameters.get(key) or 0) for key in THREAD_PARAMETERS)
        self.session = serving.OnnxSession(
            path, inputs, outputs, max_batch_size=self.max_batch_size, intra_op_threads=intra,
            inter_op_threads=inter, what=what,
        )
        self.readers = [(name, serving.tensor_reader(spec, gpu=False)) for name, spec in inputs.items()]
        self.writers = {name: serving.tensor_writer(spec, pb_utils) for name, spec in outputs.items()}
        self.outputs = list(outputs)
        logger = getattr(pb_utils, "Logger", None)
        if logger is not None:
            logger.log_warn(f"model {self.name!r} is a STAND-IN: {parameters.get(STAND_IN_PARAMETER, '')}")

    def execute(self, requests):
        inputs, errors, wanted = [], [], []
        for request in requests:
            wanted.append([n for n in (request.requested_output_names() or ()) if n in self.writers] or self.outputs)
            try:
                inputs.append(self._read(request))
                errors.append(None)
            except Exception as exc:  # a bad request is answered alone; the others go on
                inputs.append(None)
                errors.append(self._message(exc))
        results = self._run(inputs, errors, wanted)
        return [self._respond(*answer) for answer in zip(results, errors, wanted, strict=True)]

    def finalize(self):
        session = getattr(self, "session", None)
        if session is not None:
            session.close()

    # ------------------------------------------------------------------ helpers

    def _read(self, request):
        arrays = {}
        for name, read in self.readers:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:  # Triton lets no such request through; said anyway
                raise serving.Refused(f"input {name!r} is missing from the request", name)
            arrays[name] = read(tensor)
        return arrays

    def _run(self, inputs, errors, wanted):
        """One result dict per request (``None`` where ``errors`` holds the reason)."""
        good = [i for i, e in enumerate(errors) if e is None]
        results = [None] * len(inputs)
        if len(good) > 1 and self.max_batch_size > 0 and serving.concatenable([inputs[i] for i in good]):
            first = next(iter(inputs[good[0]]), None)
            sizes = [int(inputs[i][first].shape[0]) for i in good] if first is not None else []
            names = [n for n in self.outputs if any(n in wanted[i] for i in good)]
            joined = serving.run_joined([inputs[i] for i in good], sizes, lambda arrays, _: self.session.run(arrays, names))
            if joined is not None:  # else one by one below, so only the culprit fails
                for k, i in enumerate(good):
                    results[i] = {n: joined[k][n] for n in wanted[i]}
                return results
        for i in good:
            try:
                results[i] = self.session.run(inputs[i], wanted[i])
            except Exception as exc:
                errors[i] = self._message(exc)
        return results

    def _respond(self, result, error, wanted):
        if error is not None:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error))
        return pb_utils.InferenceResponse(output_tensors=[self.writers[n](n, result[n]) for n in wanted])

    def _message(self, exc):
        return f"onnxruntime stand-in of model {self.name!r}: {type(exc).__name__}: {exc}"

