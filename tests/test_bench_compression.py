"""The bench's requests travel as tritonclient's blocking client and perf_analyzer send them:
no compression unless ``--compression`` asks for it, and then the report says so.

A recording TCP proxy between the bench and the real embedded server reads the bytes
both ways: the ``Accept-Encoding`` the client sent, and the ``Content-Encoding`` Triton
answered with.
"""

from __future__ import annotations

import asyncio
import io
import threading
from contextlib import ExitStack

import pytest

from pipelines.bench import BenchSettings, run_benchmark
from pipelines.bench.runner import write_bench_repository
from pipelines.errors import PipelinesError
from pipelines.examples.basic import make_chain


class RecordingProxy:
    """Forwards one TCP port to another in a thread of its own, keeping every byte that passed."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.sent = bytearray()  # client -> server
        self.answered = bytearray()  # server -> client
        self._ready = threading.Event()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> RecordingProxy:
        self._thread.start()
        assert self._ready.wait(10), "the proxy did not start"
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    @property
    def url(self) -> str:
        return f"127.0.0.1:{self.port}"

    def clear(self) -> None:
        self.sent.clear()
        self.answered.clear()

    def _run(self) -> None:
        self._loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        server = await asyncio.start_server(self._pipe, "127.0.0.1", 0)
        self.port = server.sockets[0].getsockname()[1]
        self._ready.set()
        async with server:
            await self._stop.wait()

    async def _pipe(self, client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        server_r, server_w = await asyncio.open_connection("127.0.0.1", self.target_port)

        async def copy(reader, writer, into: bytearray) -> None:
            try:
                while data := await reader.read(1 << 16):
                    into.extend(data)
                    writer.write(data)
                    await writer.drain()
            except (ConnectionError, asyncio.CancelledError):
                pass
            finally:
                writer.close()

        await asyncio.gather(copy(client_r, server_w, self.sent), copy(server_r, client_w, self.answered))


def _headers(raw: bytearray, name: bytes) -> set[bytes]:
    """Every value of header ``name`` in the HTTP messages that passed (bodies are binary, so
    only lines that look like that header count)."""
    values = set()
    for line in bytes(raw).split(b"\r\n"):
        key, _, value = line.partition(b":")
        if key.strip().lower() == name:
            values.add(value.strip().lower())
    return values


@pytest.fixture(scope="module")
def proxied_server(tmp_path_factory):
    from pipelines.triton import TritonServer

    pipeline = make_chain(steps=2, name="chain_compression")
    with ExitStack() as stack:
        repo = write_bench_repository(pipeline, tmp_path_factory.mktemp("compression"), stack)
        server = stack.enter_context(TritonServer(repo))
        port = int(server.http_url.rsplit(":", 1)[1])
        proxy = stack.enter_context(RecordingProxy(port))
        yield pipeline, proxy


def _bench(pipeline, proxy, **options):
    proxy.clear()
    settings = BenchSettings(url=proxy.url, local=False, forms=("ensemble",), concurrency=(1,), requests=5,
                             warmup=0, max_trials=3, **options)
    echo = io.StringIO()
    result = run_benchmark(pipeline, settings, out=None, progress=False, echo=echo)
    assert not any(m.errors for m in result.measurements)
    return echo.getvalue()


@pytest.mark.server
def test_the_bench_asks_for_no_compression_and_triton_sends_none(proxied_server):
    pipeline, proxy = proxied_server
    report = _bench(pipeline, proxy)
    accepted = _headers(proxy.sent, b"accept-encoding")
    assert accepted == {b"identity"}, f"the bench asked for {accepted}"
    assert _headers(proxy.sent, b"content-encoding") == set()
    assert _headers(proxy.answered, b"content-encoding") == set(), "Triton compressed its answers"
    assert b"inference-header-content-length" in bytes(proxy.answered).lower()  # answers did pass the proxy
    assert "compressed" not in report


@pytest.mark.server
@pytest.mark.parametrize("algorithm", ["gzip", "deflate"])
def test_compression_is_measured_on_purpose_and_said_in_the_report(proxied_server, algorithm):
    pipeline, proxy = proxied_server
    report = _bench(pipeline, proxy, compression=algorithm)
    assert _headers(proxy.sent, b"accept-encoding") == {algorithm.encode()}
    assert _headers(proxy.sent, b"content-encoding") == {algorithm.encode()}
    assert _headers(proxy.answered, b"content-encoding") == {algorithm.encode()}
    assert f"compressed with {algorithm} (--compression)" in report


def test_an_unknown_compression_is_refused_with_the_choices():
    with pytest.raises(PipelinesError, match="--compression must be one of gzip, deflate; got 'br'"):
        BenchSettings(compression="br", server=False)
