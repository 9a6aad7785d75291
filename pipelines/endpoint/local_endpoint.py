"""``LocalServer``: the local runtime behind Triton's own protocol, HTTP and gRPC.

It opens one :class:`~pipelines.runtime.LocalRuntime` per mode and serves each
as the model its compiled form is named (``<name>_ensemble``, ``<name>_bls``,
``<name>_bls_sync``), so client code written for a Triton server runs
unchanged against it, and switches to the server by URL alone. It runs its own
event loop on a thread, so it serves a script, a notebook or a test alike::

    with LocalServer(p) as server:
        client = tritonclient.http.InferenceServerClient(server.http_url)
"""

from __future__ import annotations

import asyncio
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from contextlib import AsyncExitStack
from types import TracebackType
from typing import Any, TextIO

import grpc
from aiohttp import web

from ..core.graph import Graph
from ..core.plan import ensemble_refusal
from ..core.planning import plan_of
from ..errors import NotCompilableError, PipelinesError, ServerError, ServerStartError
from ..freed_memory import one_heap_here
from ..runtime.local import MODES, LocalRuntime
from ..runtime.report import Report
from .grpc_service import GRPC_OPTIONS, add_service
from .models import served_models
from .rest import DEFAULT_MAX_INPUT_SIZE, make_app
from .service import InferenceService

__all__ = ["DEFAULT_MAX_INPUT_SIZE", "GRACE_PERIOD", "LocalServer", "serve_local"]

#: Seconds that requests in flight get to finish once the server is told to stop (docs/endpoint.md promises it).
GRACE_PERIOD = 5.0


def _version() -> str:
    try:
        from importlib.metadata import version

        return version("pipelines")
    except Exception:  # an uninstalled checkout still serves
        return "0"


class LocalServer:
    """Serve ``pipeline``'s local modes over KServe v2: HTTP (binary tensor data too) and gRPC.

    ``modes``: the local modes to serve (default: every mode the pipeline can run; a pipeline
    with ``when`` blocks leaves the ensemble out, and :attr:`left_out` says why).
    Ports left as ``None`` are free ones chosen by the system; ``grpc_port=False``
    serves HTTP only. ``runtime_options`` go to each ``LocalRuntime`` (e.g.
    ``server_copies=True``). ``http_max_input_size`` bounds an HTTP request's body, as
    Triton's ``--http-max-input-size`` does, with Triton's default of 64 MiB: a larger
    request is refused unread with a 400 that names both sizes. ``start()`` returns once
    both protocols answer, and raises :class:`~pipelines.errors.ServerStartError` if they
    cannot (a port in use). ``stop()`` refuses new requests and gives those in flight
    ``GRACE_PERIOD`` (5 s) to finish, over both protocols.
    """

    def __init__(
        self,
        pipeline: Graph,
        *,
        modes: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        http_port: int | None = None,
        grpc_port: int | None | bool = None,
        runtime_options: Mapping[str, Any] | None = None,
        http_max_input_size: int = DEFAULT_MAX_INPUT_SIZE,
        start_timeout: float = 60.0,
    ) -> None:
        if not isinstance(pipeline, Graph):
            raise ServerError(f"LocalServer serves a Pipeline; got {type(pipeline).__name__}")
        if modes is not None:
            unknown = [m for m in modes if m not in MODES]
            if isinstance(modes, str) or unknown or not modes:
                raise ServerError(f"pipeline {pipeline.name!r}: modes must be some of {list(MODES)}; "
                                  f"got {modes!r}", pipeline=pipeline.name)
        if type(http_max_input_size) is not int or http_max_input_size < 1:
            raise ServerError(f"pipeline {pipeline.name!r}: http_max_input_size is the largest HTTP request body "
                              f"to accept, a number of bytes >= 1 (Triton's default: {DEFAULT_MAX_INPUT_SIZE}); "
                              f"got {http_max_input_size!r}", pipeline=pipeline.name)
        pipeline.validate()
        modes, self.left_out = _servable(pipeline, modes)
        self.pipeline = pipeline
        self.modes = modes
        self.host = host
        self._http_port = http_port
        self._grpc_port = grpc_port
        self._runtime_options = dict(runtime_options or {})
        self.http_max_input_size = http_max_input_size
        self._start_timeout = start_timeout
        self._models = served_models(pipeline, self.modes)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._ready = threading.Event()
        self._done = threading.Event()
        self._error: BaseException | None = None
        self._service: InferenceService | None = None
        self._ports: tuple[int, int | None] | None = None

    # ---------------------------------------------------------------- addresses

    @property
    def models(self) -> list[str]:
        """The served model names, one per mode."""
        return list(self._models)

    def model_name(self, mode: str) -> str:
        for name, model in self._models.items():
            if model.mode == mode:
                return name
        raise ServerError(f"pipeline {self.pipeline.name!r}: mode {mode!r} is not served; served: {list(self.modes)}")

    @property
    def http_url(self) -> str:
        """``host:port`` of the HTTP endpoint, as tritonclient takes it."""
        return f"{self._client_host}:{self._require_ports()[0]}"

    @property
    def grpc_url(self) -> str:
        port = self._require_ports()[1]
        if port is None:
            raise ServerError("this LocalServer serves HTTP only (grpc_port=False)")
        return f"{self._client_host}:{port}"

    @property
    def _client_host(self) -> str:
        return "127.0.0.1" if self.host in ("0.0.0.0", "", "::") else self.host

    def _require_ports(self) -> tuple[int, int | None]:
        if self._ports is None:
            raise ServerError("the LocalServer is not started; call start() or use 'with LocalServer(p) as server:'")
        return self._ports

    def client(self, protocol: str = "http") -> Any:
        """The library's own client (:class:`~pipelines.triton.TritonClient`) for this endpoint."""
        from ..triton.client import TritonClient

        return TritonClient(self.http_url if protocol == "http" else self.grpc_url, protocol)

    # ---------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self._thread is not None and not self._done.is_set() and self._ports is not None

    def start(self) -> LocalServer:
        if self._thread is not None:
            raise ServerError("this LocalServer is already started")
        self._done.clear()
        self._thread = threading.Thread(target=self._run, name=f"pipelines-local-{self.pipeline.name}", daemon=True)
        self._thread.start()
        if not self._ready.wait(self._start_timeout):
            self.stop()
            raise ServerStartError(f"the local endpoint for {self.pipeline.name!r} did not start in "
                                   f"{self._start_timeout:g} s")
        if self._error is not None:
            self._done.wait()
            error, self._thread = self._error, None
            if isinstance(error, PipelinesError):
                raise error
            raise ServerStartError(f"the local endpoint for {self.pipeline.name!r} could not start: "
                                   f"{type(error).__name__}: {error}") from error
        return self

    def stop(self) -> None:
        """Stop serving: refuse new requests, give those in flight up to GRACE_PERIOD to finish, close the runtimes."""
        thread, loop, stop = self._thread, self._loop, self._stop
        if thread is None:
            return
        if loop is not None and stop is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(stop.set)
            except RuntimeError:  # the loop already ended
                pass
        # An Event, not thread.join(): on Python 3.11 a Ctrl-C that lands inside join() marks the
        # thread as ended while it still runs (bpo-45274), and the process then exits under the
        # requests in flight.
        self._done.wait()
        self._thread = None
        self._ports = None

    def __enter__(self) -> LocalServer:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def wait(self) -> None:
        """Block until the server stops (Ctrl-C raises ``KeyboardInterrupt`` here, in the caller's thread)."""
        while self._thread is not None and not self._done.wait(0.5):
            pass

    # ---------------------------------------------------------------- inspection

    def statistics(self, model: str = "") -> dict:
        """Triton's statistics for ``model`` (all models if empty), as the HTTP API returns them."""
        from ..triton.payloads import message_to_dict

        return message_to_dict(self._call(lambda s: s.statistics(model)))

    def report(self, model: str) -> Report:
        """The local runtime's cost report of ``model``: per-step queue and compute, copies, parallelism."""
        return self._call(lambda s: s.report(model))

    def _call(self, fn: Any) -> Any:
        if self._service is None or self._loop is None:
            raise ServerError("the LocalServer is not started")

        async def on_loop() -> Any:
            return fn(self._service)

        return asyncio.run_coroutine_threadsafe(on_loop(), self._loop).result()

    # ---------------------------------------------------------------- the loop thread

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as exc:  # reported to start(); the thread has nothing else to tell
            self._error = exc
        finally:
            self._ready.set()
            self._done.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        async with AsyncExitStack() as stack:
            runtimes = {}
            for name, model in self._models.items():
                runtime = LocalRuntime(self.pipeline, model.mode, **self._runtime_options)
                runtimes[name] = await stack.enter_async_context(runtime)
            service = InferenceService(self._models, runtimes, _version())

            # The runtimes close last (the stack), once both front ends have stopped.
            runner = web.AppRunner(make_app(service, max_input_size=self.http_max_input_size), access_log=None,
                                   shutdown_timeout=GRACE_PERIOD)
            await runner.setup()
            server: grpc.aio.Server | None = None
            try:
                site = web.TCPSite(runner, self.host, self._http_port or 0)
                try:
                    await site.start()
                except OSError as exc:
                    raise ServerStartError(f"the local endpoint cannot listen for HTTP on {self.host}:"
                                           f"{self._http_port or 0}: {exc.strerror or exc}") from None
                http_port = int(runner.addresses[0][1])

                grpc_port = None
                if self._grpc_port is not False:
                    server = grpc.aio.server(options=GRPC_OPTIONS)
                    add_service(server, service)
                    wanted = int(self._grpc_port or 0)
                    try:
                        grpc_port = server.add_insecure_port(f"{self.host}:{wanted}")
                    except RuntimeError as exc:
                        raise ServerStartError(f"the local endpoint cannot listen for gRPC on {self.host}:{wanted}: "
                                               f"{exc}") from None
                    await server.start()

                self._service = service
                self._ports = (http_port, grpc_port)
                service.ready = True
                self._ready.set()
                await self._stop.wait()
            finally:
                service.ready = False
                await _stop_front_ends(runner, server, service)


async def _stop_front_ends(runner: web.AppRunner, server: grpc.aio.Server | None, service: InferenceService) -> None:
    """Stop both protocols at once: no new request is taken, those in flight get GRACE_PERIOD to finish.

    HTTP closes its listening socket and idle connections and waits for running handlers;
    gRPC answers new calls ``UNAVAILABLE`` and waits for running ones. Only what is still
    running after the grace period is cancelled: streams too, whose generators are closed
    before the runtimes are.
    """
    async def cancel_streams_late() -> None:
        await asyncio.sleep(GRACE_PERIOD)
        await service.cancel_streams(GRACE_PERIOD)

    late = asyncio.ensure_future(cancel_streams_late())
    stops = [runner.cleanup()]
    if server is not None:
        stops.append(server.stop(GRACE_PERIOD))
    try:
        await asyncio.gather(*stops)
    finally:
        late.cancel()
    await service.cancel_streams(GRACE_PERIOD)  # what the front ends let go of may still stream


def _servable(pipeline: Graph, modes: Sequence[str] | None) -> tuple[tuple[str, ...], str | None]:
    """The modes to serve, and why the ensemble was left out (None: it was not).

    As ``compile("all")``, bench and predict do, a pipeline with ``when`` blocks leaves the ensemble out
    when no mode was named, and refuses it when it was.
    """
    plan = plan_of(pipeline, warn=False)
    what = "the local 'ensemble' mode"
    if not plan.conditional:
        return tuple(MODES if modes is None else modes), None
    if modes is None:
        return tuple(m for m in MODES if m != "ensemble"), ensemble_refusal(plan, what=what)
    if "ensemble" in modes:
        others = ",".join(m for m in modes if m != "ensemble") or ",".join(m for m in MODES if m != "ensemble")
        raise NotCompilableError(
            f"{ensemble_refusal(plan, what=what)}: serve the other modes "
            f"(--modes {others}, or LocalServer(p, modes=[...]) without 'ensemble')",
            pipeline=pipeline.name,
        )
    return tuple(modes), None


def serve_local(
    pipeline: Graph,
    *,
    host: str = "127.0.0.1",
    http_port: int | None = None,
    grpc_port: int | None = None,
    out: TextIO | None = None,
    **options: Any,
) -> int:
    """Serve in the foreground until Ctrl-C (``pipelines serve --local``); prints the URLs when ready."""
    out = out or sys.stdout
    one_heap_here()  # this process is the endpoint's alone: large gRPC messages leave nothing behind
    server = LocalServer(pipeline, host=host, http_port=http_port, grpc_port=grpc_port, **options)
    if server.left_out is not None:
        print(f"ensemble left out: {server.left_out}", file=out, flush=True)
    server.start()
    if threading.current_thread() is threading.main_thread():
        # a service manager's SIGTERM stops it as cleanly as Ctrl-C
        signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        print(f"serving pipeline {pipeline.name!r} from the local runtime, models: {', '.join(server.models)}", file=out)
        print(f"  HTTP  {server.http_url}    tritonclient.http.InferenceServerClient({server.http_url!r})", file=out)
        print(f"  gRPC  {server.grpc_url}    tritonclient.grpc.InferenceServerClient({server.grpc_url!r})", file=out)
        print("ready; Ctrl-C stops it", file=out, flush=True)
        server.wait()
    except KeyboardInterrupt:
        print("stopping", file=out, flush=True)
    finally:
        server.stop()
    return 0
