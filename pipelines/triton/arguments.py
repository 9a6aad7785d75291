"""The server's command line as data: one frozen dataclass, validated when built, rendered once.

What the rest of the package needs to know about the arguments (which ports the server
listens on, the shared-memory prefix) is read from the fields, never parsed back from strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ServerStartError
from ..freed_memory import VARIABLES

__all__ = ["MODEL_CONTROL_MODES", "Ports", "PythonBackendSettings", "ServerArguments"]

MODEL_CONTROL_MODES = ("none", "explicit", "poll")
# The flags TritonServer sets itself (passing them again in extra_args would contradict it),
# each with what to pass instead.
_OWNED_FLAGS = {
    "--model-repository": "the repository argument",
    "--backend-directory": "installation=TritonInstallation(...) (the backends come with the server binary)",
    "--model-control-mode": "model_control_mode=",
    "--load-model": "load_models=",
    "--http-address": "host=",
    "--http-port": "http_port=",
    "--grpc-address": "host=",
    "--grpc-port": "grpc_port=",
    "--metrics-address": "host=",
    "--metrics-port": "metrics_port=",
    "--exit-timeout-secs": "exit_timeout=",
    "--log-verbose": "log_verbose=",
    "--allow-grpc": "allow_grpc=",
    "--allow-metrics": "allow_metrics=",
    "--exit-on-error": "exit_on_error= (True also makes readiness strict)",
    "--strict-readiness": "exit_on_error= (True also makes readiness strict)",
}


@dataclass(frozen=True)
class PythonBackendSettings:
    """The Python backend's shared-memory settings (``--backend-config=python,...``); None keeps Triton's.

    Each model instance's stub talks to the server through one shared-memory region in
    ``/dev/shm``. It starts at ``shm_default_byte_size`` (Triton: 1 MiB) and grows by
    ``shm_growth_byte_size`` (1 MiB) steps whenever a request's tensors do not fit, and it
    never shrinks until the server stops: one request with large tensors holds that memory
    for good. A larger default avoids growth for requests that fit; a larger growth step
    means fewer, larger increments (fewer remaps on large tensors, more memory held).
    ``stub_timeout_seconds`` (30) is how long the backend waits for a stub's handshakes.

    ``keep_freed_memory`` (on by default) has each stub's ``malloc`` keep the memory
    its arrays free, for the next call, instead of handing it back to the kernel
    after each one: a step that makes one fresh 4 MiB array per call then spends
    1.2 ms in its stub rather than 3.7 ms, the difference being page faults
    (measured on Triton 2.51, docs/calibration_internals.md; see :mod:`pipelines.freed_memory`). It sets glibc's
    ``MALLOC_MMAP_THRESHOLD_`` (32 MiB) and ``MALLOC_TRIM_THRESHOLD_`` (64 MiB) in the
    server's environment, which its stubs inherit: arrays under 32 MiB come from the
    heap, and each process keeps up to 64 MiB of freed heap. Variables of the same
    name in ``env`` (or the environment) win.
    """

    shm_default_byte_size: int | None = None
    shm_growth_byte_size: int | None = None
    stub_timeout_seconds: int | None = None
    keep_freed_memory: bool = True

    def __post_init__(self) -> None:
        for name in ("shm_default_byte_size", "shm_growth_byte_size", "stub_timeout_seconds"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ServerStartError(f"PythonBackendSettings.{name} must be a positive int (or None); got {value!r}")

    def environment(self) -> dict[str, str]:
        """The variables these settings add to the server's environment."""
        if not self.keep_freed_memory:
            return {}
        return dict(VARIABLES)

    def flags(self, shm_region_prefix: str) -> list[str]:
        """The ``--backend-config=python,KEY=VALUE`` flags, one per setting that is set."""
        settings = {
            "shm-region-prefix-name": shm_region_prefix or None,
            "shm-default-byte-size": self.shm_default_byte_size,
            "shm-growth-byte-size": self.shm_growth_byte_size,
            "stub-timeout-seconds": self.stub_timeout_seconds,
        }
        return [f"--backend-config=python,{key}={value}" for key, value in settings.items() if value is not None]


_PYTHON_BACKEND_KEYS = (
    "shm-region-prefix-name",
    "shm-default-byte-size",
    "shm-growth-byte-size",
    "stub-timeout-seconds",
)


@dataclass(frozen=True)
class Ports:
    """The three ports a server listens on."""

    http: int
    grpc: int
    metrics: int


@dataclass(frozen=True)
class ServerArguments:
    """What a ``tritonserver`` is started with, apart from where it is installed and its ports."""

    repository: Path
    model_control_mode: str = "none"
    load_models: tuple[str, ...] = ()
    host: str = "127.0.0.1"
    exit_timeout: int = 5
    log_verbose: int = 0
    allow_grpc: bool = True
    allow_metrics: bool = True
    #: Triton's own default: a model that fails to load stops the start. Off, the others are served.
    exit_on_error: bool = True
    #: The Python backend names its shared-memory regions ``<prefix><uuid>``.
    shm_region_prefix: str = ""
    python_backend: PythonBackendSettings = field(default_factory=PythonBackendSettings)
    extra: tuple[str, ...] = field(default=())

    def __post_init__(self) -> None:
        if self.model_control_mode not in MODEL_CONTROL_MODES:
            raise ServerStartError(
                f"model_control_mode={self.model_control_mode!r} is not one Triton knows; "
                f"use one of {', '.join(map(repr, MODEL_CONTROL_MODES))}"
            )
        if self.load_models and self.model_control_mode != "explicit":
            raise ServerStartError(
                f"load_models={list(self.load_models)!r} needs model_control_mode='explicit'; "
                f"in mode {self.model_control_mode!r} Triton loads every model of the repository itself"
            )
        for arg in self.extra:
            flag, _, value = arg.partition("=")
            key = value.removeprefix("python,").split("=", 1)[0]
            if flag == "--backend-config" and value.startswith("python,") and key in _PYTHON_BACKEND_KEYS:
                raise ServerStartError(
                    f"extra argument {arg!r} sets the Python backend's {key}; pass "
                    f"python_backend=PythonBackendSettings({key.replace('-', '_')}=...) instead"
                    + (
                        " (the region prefix is the server's own: clean-up finds its regions by it)"
                        if key == "shm-region-prefix-name"
                        else ""
                    )
                )
            if flag in _OWNED_FLAGS:
                raise ServerStartError(
                    f"extra argument {arg!r} sets {flag}, which TritonServer sets itself; "
                    f"pass TritonServer's {_OWNED_FLAGS[flag]} instead"
                )

    def command(
        self, *, binary: Path, backend_directory: Path, ports: Ports, repository: Path | None = None
    ) -> list[str]:
        """The ``tritonserver`` command line; ``repository`` is the path to give Triton for
        :attr:`repository` (a link to it), where that differs."""
        args = [
            str(binary),
            f"--model-repository={repository or self.repository}",
            f"--backend-directory={backend_directory}",
            f"--model-control-mode={self.model_control_mode}",
            f"--http-address={self.host}",
            f"--http-port={ports.http}",
            f"--grpc-address={self.host}",
            f"--grpc-port={ports.grpc}",
            f"--metrics-address={self.host}",
            f"--metrics-port={ports.metrics}",
            f"--exit-timeout-secs={self.exit_timeout}",
            f"--log-verbose={self.log_verbose}",
        ]
        if not self.allow_grpc:
            args.append("--allow-grpc=false")
        if not self.allow_metrics:
            args.append("--allow-metrics=false")
        if not self.exit_on_error:
            # Ready then means the server is up, not that every model loaded: which did not is
            # asked of the repository index once it is.
            args += ["--exit-on-error=false", "--strict-readiness=false"]
        args += self.python_backend.flags(self.shm_region_prefix)
        args += [f"--load-model={name}" for name in self.load_models]
        args += self.extra
        return args

    def listening_ports(self, ports: Ports) -> list[int]:
        """The ports the started server must hold before it counts as ready."""
        listening = [ports.http]
        if self.allow_grpc:
            listening.append(ports.grpc)
        if self.allow_metrics:
            listening.append(ports.metrics)
        return listening
