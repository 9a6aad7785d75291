"""Triton Python-backend adapter that serves one pipeline step.

Copied verbatim as ``<model>/1/model.py``, with the ``serving/`` package beside it. It
reads ``step.json``, loads the step (by import, or from ``step.pkl`` by value),
runs its lifecycle, and answers each list of requests with one batched call,
falling back to one call per request so that a failing request cannot take its
neighbours down. A streaming step (``"stream"`` in ``step.json``) is served decoupled:
one response per yield, then the final flag alone (:class:`_Streams`). It imports only
the standard library, numpy and ``serving``, so a server needs no ``pipelines``
package (docs/triton.md).
"""

from __future__ import annotations

import asyncio
import json
import re

import numpy as np

try:  # in a repository: the copy beside this file (the stub imports this file as "<version>.model")
    from . import serving
except ImportError:  # in the package, for tests and linters
    from pipelines import serving

pb_utils = serving.pb_utils  # Triton's triton_python_backend_utils in a stub; None elsewhere


class TritonPythonModel:
    def initialize(self, args):
        version_dir, plan = serving.model_plan(args, "step.json")
        self.pipeline = plan["pipeline"]
        self.step_name = plan["step"]
        self.step_file = plan.get("file")  # the step's source file, which by-value code no longer names
        serving.HOPS.attach(args.get("model_name", self.step_name))
        nodes = plan.get("nodes") or [self.step_name]
        ensemble = plan.get("ensemble") or {}
        # A model shared by several nodes learns, request by request, which node called it from the
        # name its first input arrives under (compile/ensemble.py, node aliases); called by that
        # input's own name (a BLS model, a client), it names no node.
        self.node = nodes[0] if len(nodes) == 1 else None
        self.node_input = ensemble.get("node_input")
        self.node_aliases = ensemble.get("node_aliases") or {}
        self.max_batch_size = int(plan["max_batch_size"])
        gpu = plan.get("device") == "gpu"
        inputs = {n: serving.Spec.from_dict(s) for n, s in plan["inputs"].items()}
        outputs = {n: serving.Spec.from_dict(s) for n, s in plan["outputs"].items()}
        model_config = json.loads(args["model_config"]) if "model_config" in args else None
        declared = _without_aliases(model_config, self.node_input, self.node_aliases)
        checked = serving.config_declares(declared, inputs, self.max_batch_size)
        self.takes = serving.Contract(inputs, self.max_batch_size, checked_by_triton=checked)
        self.gives = serving.Contract(outputs, self.max_batch_size)
        # Decided once here, not per request: how each tensor is read and written.
        self.readers = [(name, serving.tensor_reader(spec, gpu=gpu)) for name, spec in inputs.items()]
        self.writers = {name: serving.tensor_writer(spec, pb_utils) for name, spec in outputs.items()}
        self.outputs = outputs
        self.ensemble = _EnsembleExtras(ensemble, gpu)
        serving.refuse_strings_under_numpy_2(
            args.get("model_name", self.step_name),
            [n for n, spec in {**inputs, **outputs}.items() if spec.dtype == "BYTES"],
        )
        # One output and no ensemble extras: no need to ask a request which outputs it wants.
        self.one_output = next(iter(outputs)) if len(outputs) == 1 and not self.ensemble.active else None
        self.instance = serving.StepInstance(
            self.step_name,
            serving.load_impl(plan["impl"], version_dir),
            list(outputs),
            self._config(args, plan, inputs, outputs),
            array=plan.get("array"),
        )
        # The fast path reads with as_numpy() and writes Tensor(name, ndarray), which numpy 2 breaks (docs/gpu.md).
        host = not gpu and not serving.NUMPY_2 and all(spec.dtype != "BF16" for spec in inputs.values())
        self.answer_one = self._fast_path() if host and self.takes.checked_by_triton else self._answer_one
        stream = plan.get("stream")
        self.streams = _Streams(self, stream) if stream is not None else None

    def _config(self, args, plan, inputs, outputs):
        match = re.search(r"_(\d+)$", args.get("model_instance_name", ""))
        config = serving.instance_config(
            step=self.step_name,
            inputs=inputs,
            outputs=outputs,
            parameters=plan.get("parameters") or {},
            max_batch_size=self.max_batch_size,
            pipeline=self.pipeline,
            node=self.node,
            model_name=args.get("model_name"),
            instance_index=int(match.group(1)) if match else 0,
            device="gpu" if args.get("model_instance_kind") == "GPU" else "cpu",
            model_config=json.loads(args["model_config"]) if "model_config" in args else None,
        )
        # Triton's own values for the keys it gives, exactly as it gave them.
        config.update({k: args[k] for k in ("model_version", "model_instance_name", "model_instance_kind",
                                            "model_instance_device_id") if k in args})
        return config

    def execute(self, requests):
        if self.streams is not None:  # decoupled: every answer goes through the requests' response senders
            for request in requests:
                self.streams.serve(request)
            return None
        if len(requests) == 1 and not self.ensemble.active:
            return [self.answer_one(requests[0])]
        inputs, errors = [], []
        for request in requests:
            try:
                upstream = self.ensemble.upstream_error(request)
                if upstream is not None:
                    inputs.append(None)  # a step upstream failed: running on its stand-ins would be garbage
                    errors.append(upstream)  # passed on, to the gate or as this step's error response
                    continue
                inputs.append(self._read(request))
                errors.append(None)
            except Exception as exc:  # a bad request is answered alone; the others go on
                inputs.append(None)
                errors.append(self._message(exc, "InputError", request))
        results = self._run(requests, inputs, errors)
        return [self._respond(r, res, err) for r, res, err in zip(requests, results, errors, strict=True)]

    def finalize(self):
        streams = getattr(self, "streams", None)
        if streams is not None:
            streams.close()
        instance = getattr(self, "instance", None)
        if instance is not None:
            instance.finalize()

    # ------------------------------------------------------------------ helpers

    def _answer_one(self, request):
        """A lone request (concurrency 1, or a batcher that found no company): no batch bookkeeping."""
        try:
            arrays, size = self._read(request)
        except Exception as exc:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                self._message(exc, "InputError", request)))
        try:
            result = self._call(arrays, size)
        except Exception as exc:
            return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(
                self._message(exc, "StepError", request)))
        return self._respond(request, result, None)

    def _fast_path(self):
        """``_answer_one`` in one frame, for the common case: host inputs that Triton has checked.

        A Python call costs microseconds in a stub, so this binds what it needs here,
        once, and does inline what the general path does through calls: call the step,
        check its one output's dtype and shape (anything unusual goes to the full checks,
        which word the error), and answer. Same results and errors as ``_answer_one``.
        """
        get, response, error, make = (pb_utils.get_input_tensor_by_name, pb_utils.InferenceResponse,
                                      pb_utils.TritonError, pb_utils.Tensor)
        names = [name for name, _ in self.readers]
        first = names[0] if names and self.max_batch_size > 0 else None
        fn, normalise = self.instance.function, self.instance.normalise
        declared = frozenset(self.instance.outputs)
        check, message, slow, respond = self.gives.check_outputs, self._message, self._answer_one, self._respond
        out = self.one_output
        spec = self.outputs[out] if out is not None else None
        # The one output checked inline: a numeric numpy array of the declared dtype and shape.
        inline = spec is not None and spec.dtype not in ("BYTES", "BF16") and -1 not in spec.dims
        dtype = serving.numpy_dtype(spec.dtype) if inline else None
        body = tuple(spec.dims) if inline else None
        ndarray = np.ndarray
        alias_of, aliased = self.node_input, self._aliased  # a shared model's first input comes under an alias

        def answer(request):
            arrays = {}
            for name in names:
                tensor = get(request, name)
                if tensor is None:
                    tensor = aliased(request) if name == alias_of else None
                    if tensor is None:  # Triton lets no such request through; the slow path words it anyway
                        return slow(request)
                arrays[name] = tensor.as_numpy()
            rows = arrays[first].shape[0] if first is not None else None
            try:
                outputs = fn(**arrays)
                if type(outputs) is not dict or outputs.keys() != declared:
                    outputs = normalise(outputs)
                if inline:
                    value = outputs[out]
                    if type(value) is ndarray and value.dtype == dtype and (
                        (value.shape[1:] == body and value.shape[0] == rows) if rows is not None else value.shape == body
                    ):
                        return response([make(out, value)])
                outputs = serving.as_arrays(dict(outputs))
                check(outputs, rows)
            except Exception as exc:
                return response(output_tensors=[], error=error(message(exc, "StepError", request)))
            return respond(request, outputs, None)

        return answer

    def _read(self, request):
        arrays = {}
        for name, read in self.readers:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None and name == self.node_input:
                tensor = self._aliased(request)
            if tensor is None:
                raise serving.Refused(f"input {name!r} ({self.takes.specs[name]}) is missing from the request", name)
            arrays[name] = read(tensor)
        return arrays, self.takes.check_inputs(arrays)

    def _run(self, requests, inputs, errors):
        """One result dict per request (``None`` where ``errors`` holds the reason)."""
        good = [i for i, e in enumerate(errors) if e is None]
        results = [None] * len(inputs)
        if len(good) > 1 and self.max_batch_size > 0 and serving.concatenable([inputs[i][0] for i in good]):
            joined = serving.run_joined([inputs[i][0] for i in good], [inputs[i][1] for i in good], self._call)
            if joined is not None:  # else one by one below, so only the culprit fails
                for k, i in enumerate(good):
                    results[i] = joined[k]
                return results
        for i in good:
            try:
                results[i] = self._call(*inputs[i])
            except Exception as exc:
                errors[i] = self._message(exc, "StepError", requests[i])
        return results

    def _call(self, arrays, batch_size):
        outputs = serving.as_arrays(self.instance.execute(arrays))
        self.gives.check_outputs(outputs, batch_size)
        return outputs

    def _respond(self, request, result, error):
        if error is None and self.one_output is not None:
            name = self.one_output
            return pb_utils.InferenceResponse(output_tensors=[self.writers[name](name, result[name])])
        wanted = set(request.requested_output_names() or ())
        if error is not None:
            if self.ensemble.err_output not in wanted:
                return pb_utils.InferenceResponse(output_tensors=[], error=pb_utils.TritonError(error))
            result = self.ensemble.placeholders(request, self.outputs, self.max_batch_size)
        wanted = wanted or set(result)
        tensors = [self.writers[n](n, result[n]) for n in result if n in wanted]
        tensors += self.ensemble.extra_tensors(result, wanted, error, self.max_batch_size, self.writers)
        return pb_utils.InferenceResponse(output_tensors=tensors)

    def _aliased(self, request):
        """The first input of a shared model, as it came from a node: under that node's alias."""
        for tensor in request.inputs():
            if tensor.name() in self.node_aliases:
                return tensor
        return None

    def _node_of(self, request):
        """The node that sent ``request``: this model's one node, or the one its alias names."""
        if request is None or not self.node_aliases:
            return self.node
        tensor = self._aliased(request)
        return self.node_aliases[tensor.name()] if tensor is not None else None

    def _message(self, exc, kind, request=None, before=""):
        """The error text a client reads pipeline, node, step and reason from (``serving.WireError``);
        ``before`` goes in front of the reason (``response 3:`` in a stream)."""
        if isinstance(exc, serving.Refused):
            reason, tensor = str(exc), exc.tensor
        else:
            instance = getattr(self, "instance", None)
            reason = serving.exception_reason(exc, instance.home if instance else None, self.step_file)
            tensor = None
            kind = "StepError"
        reason = f"{before} {reason}" if before else reason
        return serving.WireError(kind, self.pipeline, reason, self._node_of(request), self.step_name, tensor).text()


def _without_aliases(model_config, node_input, aliases):
    """``model_config`` as if a shared model took ``node_input`` under its own name alone, required.

    Triton checks the dtype and dims of every input a request gives, optional or not, so only
    that input's presence is left to this adapter, which reads it under the name it came by.
    """
    if not model_config or node_input is None:
        return model_config
    inputs = [dict(i) for i in model_config.get("input", ()) if i.get("name") not in aliases]
    for entry in inputs:
        if entry.get("name") == node_input:
            entry.pop("optional", None)
    return {**model_config, "input": inputs}


class _EnsembleExtras:
    """What an ensemble adds to a step model: output copies, and failures carried as data.

    Triton's ensemble asks a step for every output its ``output_map`` names, so a copy
    is paid on each call of a node that has one. A failure is written in the
    ``__err__`` output only when the caller asked for it (the ensemble does; the BLS
    forms do not and get error responses, which they handle safely).
    """

    def __init__(self, data, gpu=False):
        self.copies = data.get("copies") or {}
        self.err_inputs = data.get("err_inputs") or []
        self.err_output = data.get("err_output")
        self.dims = data.get("placeholders") or {}
        self.active = bool(self.copies or self.err_inputs or self.err_output)
        # a streaming step's: output -> (its input, a reader, a writer), the request's tensors sent on each response
        self.carries = {out: (c["input"], serving.tensor_reader(serving.Spec.from_dict(c["spec"]), gpu=gpu),
                              serving.tensor_writer(serving.Spec.from_dict(c["spec"]), pb_utils))
                        for out, c in (data.get("carries") or {}).items()}
        self.err_writer = serving.tensor_writer(serving.Spec("UINT8", (-1,)), pb_utils)

    def upstream_error(self, request):
        """The failure text a step upstream wrote (the first, in the order of the inputs), or ``None``."""
        for name in self.err_inputs:
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is None:
                continue
            text = serving.failure_text(tensor)
            if text is not None:
                return text
        return None

    def placeholders(self, request, outputs, max_batch_size):
        """Stand-in outputs of the declared dtypes, for the steps downstream to skip and the gate to drop."""
        lead = []
        if max_batch_size > 0:
            given = request.inputs()
            lead = [int(given[0].shape()[0])] if given and len(given[0].shape()) else [1]
        out = {}
        for name, spec in outputs.items():
            shape = lead + list(self.dims.get(name, [1 if d == -1 else d for d in spec.dims]))
            out[name] = np.full(shape, b"", dtype=np.object_) if spec.dtype == "BYTES" else np.zeros(
                shape, spec.numpy_dtype
            )
        return out

    def extra_tensors(self, result, wanted, error, max_batch_size, writers):
        tensors = [writers[original](alias, result[original]) for alias, original in self.copies.items() if alias in wanted]
        if self.err_output in wanted:
            # the wire text (serving.WireError), or none; the gate says which node this was
            rows = len(next(iter(result.values()))) if max_batch_size > 0 and result else None
            failure = serving.failure_tensor(error or "", rows)
            tensors.append(self.err_writer(self.err_output, failure))
        return tensors


class _Streams:
    """A streaming step served decoupled (docs/compiled_repository.md, "Streaming steps").

    Per request: one response per yield through the request's response sender, each with
    the UINT8 ``__err__`` output flagged 0, then the final flag alone. A failure (the
    generator raised, a yield broke the declared outputs, the step's timeout passed, a step
    upstream failed) is one ordinary response of placeholder outputs whose ``__err__`` holds
    the wire error, then the final flag: never an error response, which a BLS model calling
    this one would not see, or would wait on for ever (docs/triton_decoupled.md).
    """

    def __init__(self, model, data):
        self.model = model
        self.err_output = data.get("err_output") or "__err__"
        self.timeout_s = float(data.get("timeout_s") or 0)
        model.ensemble.err_output = self.err_output  # written on every response, asked for or not
        model.ensemble.active = True
        self.loop = None  # an event loop of its own, made for the first async generator
        self.carried = []

    def serve(self, request):
        sender = request.get_response_sender()
        try:
            self._respond(request, sender)
        except Exception as exc:  # a fault of ours (a tensor that would not write): still one answer
            self._fail(request, sender, None, self.model._message(exc, "StepError", request))
        finally:
            sender.send(flags=pb_utils.TRITONSERVER_RESPONSE_COMPLETE_FINAL)

    def close(self):
        if self.loop is not None:
            self.loop.close()

    def _respond(self, request, sender):
        model = self.model
        wanted = set(request.requested_output_names() or ()) or None
        self.carried = []  # the request's tensors, sent again on each response (docs: "Streaming steps")
        for out, (name, read, write) in model.ensemble.carries.items():
            tensor = pb_utils.get_input_tensor_by_name(request, name)
            if tensor is not None and (wanted is None or out in wanted):
                self.carried.append((out, read(tensor), write))
        upstream = model.ensemble.upstream_error(request)
        if upstream is not None:  # its inputs are stand-ins: pass the failure on, as a plain step does
            return self._fail(request, sender, wanted, upstream)
        try:
            arrays, rows = model._read(request)
        except Exception as exc:
            return self._fail(request, sender, wanted, model._message(exc, "InputError", request))
        try:
            pull = serving.Pull(model.instance.function(**arrays), self.timeout_s, self._loop)
        except Exception as exc:
            return self._fail(request, sender, wanted, model._message(exc, "StepError", request))
        sent = 0
        try:
            # A client that cancels a direct call stops the generator; an ensemble or a BLS model
            # does not pass its cancellation on (docs/triton_decoupled.md), so there it runs on.
            # Asked between two responses, not before the first: each ask is a round trip to the
            # server process, which the first response would wait for.
            while not (sent and sender.is_cancelled()):
                try:
                    item = pull.next()
                except serving.PastTimeout:
                    return self._fail(request, sender, wanted, self._timed_out(request, sent, pull.stuck))
                except Exception as exc:
                    text = model._message(exc, "StepError", request, f"(after {sent} responses)")
                    return self._fail(request, sender, wanted, text)
                if item is serving.END:
                    return None
                try:
                    outputs = serving.as_arrays(model.instance.normalise(item))
                    model.gives.check_outputs(outputs, rows)
                except Exception as exc:  # responses are numbered from 1, as `pipelines run` shows them
                    return self._fail(request, sender, wanted, model._message(exc, "StepError", request, f"response {sent + 1}:"))
                sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(outputs, wanted, None)))
                sent += 1
        finally:
            pull.close()
        return None

    def _fail(self, request, sender, wanted, text):
        model = self.model
        stand_ins = model.ensemble.placeholders(request, model.outputs, model.max_batch_size)
        sender.send(pb_utils.InferenceResponse(output_tensors=self._tensors(stand_ins, wanted, text)))

    def _tensors(self, result, wanted, error):
        model = self.model
        tensors = [model.writers[n](n, result[n]) for n in result if wanted is None or n in wanted]
        extras = set(model.ensemble.copies) if wanted is None else wanted
        tensors += [write(out, value) for out, value, write in self.carried]
        return tensors + model.ensemble.extra_tensors(
            result, extras | {self.err_output}, error, model.max_batch_size, model.writers)

    def _timed_out(self, request, sent, stuck):
        model = self.model
        reason = (f"ran past its timeout of {self.timeout_s:g} s after {sent} responses; the stream was ended "
                  "with this error" + (", and the step may still be running" if stuck else ""))
        return serving.WireError("StepTimeoutError", model.pipeline, reason, model._node_of(request),
                                 model.step_name).text()

    def _loop(self):
        if self.loop is None:
            self.loop = asyncio.new_event_loop()
        return self.loop
