"""What runs inside a Triton server: request and output checks, a step's lifecycle, the error
wire format, tensors and rows, and the schedule of a plan. Standard library and numpy only.

The compiler copies this package, as one folder, beside each ``model.py`` of a repository, so
a server needs no ``pipelines`` package; the package uses the same functions, so the local
runtime and the server check with one set of words. Each module holds one role:

- ``datatypes``: Triton's datatypes in numpy, :class:`Spec`, which numpy runs (``NUMPY_2``);
- ``checks``: request and output checks, :class:`Refused`, :class:`Contract`;
- ``dlpack``: BF16 and host DLPack capsules, built with ctypes;
- ``wire``: the error wire format (:class:`WireError`) and how a step's exception is told;
- ``arrays``: arrays as a step returns them and asks to be handed them;
- ``tensors``: a model's pb tensors in and out, host-GPU hops, failures carried as data;
- ``lifecycle``: a step's config, its live instance and exits, its code loaded in a server;
- ``sources``: a step's own source file imported in a server, with ``pipelines`` stood in for;
- ``rows``: requests joined and split by rows, and ``when`` blocks;
- ``schedule``: a plan's nodes run concurrently, and the plan cut to the wanted outputs.
- ``streams``: a streaming step's responses pulled one at a time, within its timeout, and handed
  to a ``whole_stream`` step as iterators.
- ``stream_layout``: where each node of a streaming request runs, what it waits for, and how
  a request runs its once-per-request nodes by it.
- ``onnx_session``: an ONNX file run by onnxruntime, checked against a model's declared tensors.
"""

from __future__ import annotations

try:  # present only inside Triton's Python backend stub, which imports a model.py and so this package
    import triton_python_backend_utils as pb_utils
except ImportError:  # pragma: no cover - the package is also imported by tests, linters and the host
    pb_utils = None

from .arrays import ARRAY_KINDS, DL_HOST, as_array, as_arrays, handing, read_only
from .checks import (
    Contract,
    Fail,
    Refused,
    check_dtype,
    check_names,
    check_outputs,
    check_request,
    check_same_batch,
    check_shape,
    config_declares,
    expected,
    is_array,
    normalise_outputs,
)
from .datatypes import NUMPY_2, NUMPY_DTYPES, Spec, bfloat16, numpy_dtype
from .dlpack import HostView, bf16_from_dlpack, bf16_to_dlpack, host_capsule
from .lifecycle import (
    StepExited,
    StepInstance,
    StepInterrupted,
    instance_config,
    is_coroutine_callable,
    load_impl,
    model_plan,
)
from .onnx_session import OnnxFileError, OnnxSession, config_specs
from .rows import SKIPPED, Branches, Rows, concat_rows, concatenable, negated, run_joined, split_rows
from .schedule import Schedule, cut_plan, run_concurrently
from .stream_layout import StreamLayout, TopNodes, stream_record
from .streams import END, PastTimeout, Pull, Tee
from .tensors import (
    HOPS,
    HostHops,
    bytes_tensor,
    failure_tensor,
    failure_text,
    host_array,
    pb_array,
    refuse_strings_under_numpy_2,
    tensor_reader,
    tensor_writer,
)
from .wire import (
    WireError,
    called_model_error,
    code_home,
    exception_reason,
    parse_error,
    raised_at,
    request_tensors,
    unknown_output,
)

__all__ = [
    "ARRAY_KINDS",
    "DL_HOST",
    "END",
    "HOPS",
    "NUMPY_2",
    "NUMPY_DTYPES",
    "OnnxFileError",
    "OnnxSession",
    "PastTimeout",
    "Pull",
    "SKIPPED",
    "Branches",
    "Contract",
    "Fail",
    "HostHops",
    "HostView",
    "Refused",
    "Rows",
    "Schedule",
    "Spec",
    "StepExited",
    "StepInstance",
    "StepInterrupted",
    "StreamLayout",
    "Tee",
    "TopNodes",
    "WireError",
    "as_array",
    "as_arrays",
    "bf16_from_dlpack",
    "bf16_to_dlpack",
    "bfloat16",
    "bytes_tensor",
    "called_model_error",
    "check_dtype",
    "check_names",
    "check_outputs",
    "check_request",
    "check_same_batch",
    "check_shape",
    "code_home",
    "concat_rows",
    "concatenable",
    "config_declares",
    "config_specs",
    "cut_plan",
    "exception_reason",
    "expected",
    "failure_tensor",
    "failure_text",
    "handing",
    "host_array",
    "host_capsule",
    "instance_config",
    "is_array",
    "is_coroutine_callable",
    "load_impl",
    "model_plan",
    "negated",
    "normalise_outputs",
    "numpy_dtype",
    "parse_error",
    "pb_array",
    "raised_at",
    "read_only",
    "refuse_strings_under_numpy_2",
    "request_tensors",
    "run_concurrently",
    "pb_utils",
    "run_joined",
    "split_rows",
    "stream_record",
    "tensor_reader",
    "tensor_writer",
    "unknown_output",
]
