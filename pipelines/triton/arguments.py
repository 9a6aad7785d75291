"""The server's command line as data: one frozen dataclass, validated when built, rendered once.

What the rest of the package needs to know about the arguments (which ports the server
listens on, the shared-memory prefix) is read from the fields, never parsed back from strings.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from ..errors import ServerStartError

__all__ = ["MODEL_CONTROL_MODES", "Ports", "ServerArguments"]

MODEL_CONTROL_MODES = ("none", "explicit", "poll")
# Flags this dataclass renders itself; passing them again in ``extra`` would contradict it.
_OWNED_FLAGS = (
    "--model-repository",
    "--backend-directory",
    "--model-control-mode",
    "--load-model",
    "--http-address",
    "--http-port",
    "--grpc-address",
    "--grpc-port",
    "--metrics-address",
    "--metrics-port",
    "--exit-timeout-secs",
    "--log-verbose",
    "--allow-grpc",
    "--allow-metrics",
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
    #: The Python backend names its shared-memory regions ``<prefix><uuid>``.
    shm_region_prefix: str = ""
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
            flag = arg.split("=", 1)[0]
            if flag in _OWNED_FLAGS:
                raise ServerStartError(
                    f"extra argument {arg!r} sets {flag}, which TritonServer sets itself; "
                    "pass it as the TritonServer keyword of the same name instead"
                )

    def command(self, *, binary: Path, backend_directory: Path, ports: Ports) -> list[str]:
        """The ``tritonserver`` command line."""
        args = [
            str(binary),
            f"--model-repository={self.repository}",
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
        if self.shm_region_prefix:
            args.append(f"--backend-config=python,shm-region-prefix-name={self.shm_region_prefix}")
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
