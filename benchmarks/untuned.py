"""Two pipelines for ``benchmarks/prediction.py`` that the prediction was not tuned on (issue 59's targets):

- ``threaded``: a diamond whose branches use more than one core: ``project`` multiplies by a 512 x 2048
  matrix (numpy's BLAS, on as many threads as the machine has cores) and ``spectrum`` runs FFTs in a pool of four
  threads of its own (numpy's FFT releases the GIL), so a step's CPU time exceeds its wall time;
- ``tensor16``: a 16 MiB frame that one step smooths into another 16 MiB tensor, which two steps read (its
  statistics and its histogram): moving 16 MiB between processes several times a request.

They live beside the benchmark, as ``boundaries.py`` does, and not in ``pipelines.examples``: they are the benchmark's
fixtures, written to test the prediction on work it has not seen, not examples to learn from. Every constant here
was chosen before the first prediction of them, and none was changed after.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np

from pipelines import Pipeline, TensorSpec, step

__all__ = ["make_tensor16", "make_threaded", "tensor16", "threaded"]

ROWS, WIDTH, HIDDEN, CLASSES, BINS = 128, 512, 2048, 16, 64
FRAME = 4 << 20  # floats: 16 MiB of FP32
SIGNAL = TensorSpec("FP32", [ROWS, WIDTH])


@step(inputs={"x": SIGNAL}, outputs={"z": SIGNAL})
def standardize(x):
    mean = x.mean(axis=-1, keepdims=True)
    std = x.std(axis=-1, keepdims=True) + np.float32(1e-6)
    return {"z": ((x - mean) / std).astype(np.float32)}


@step(inputs={"z": SIGNAL}, outputs={"features": TensorSpec("FP32", [HIDDEN])})
class Project:
    """``tanh(z @ W)`` averaged over the rows: a BLAS matrix product that runs on several threads."""

    def initialize(self, config):
        self.weights = (np.random.default_rng(1).standard_normal((WIDTH, HIDDEN)) / np.sqrt(WIDTH)).astype(np.float32)

    def execute(self, z):
        hidden = np.tanh(z @ self.weights)  # (batch, ROWS, HIDDEN)
        return {"features": hidden.mean(axis=-2).astype(np.float32)}


@step(inputs={"z": SIGNAL}, outputs={"spectrum": TensorSpec("FP32", [BINS])})
class Spectrum:
    """Each request's signal in four chunks, each chunk's FFT in a thread of the step's own pool, binned."""

    def initialize(self, config):
        self.pool = ThreadPoolExecutor(4, thread_name_prefix="spectrum")

    def execute(self, z):
        chunks = z.reshape(z.shape[0], 4, -1)

        def binned(i: int) -> np.ndarray:
            power = np.abs(np.fft.rfft(chunks[:, i], axis=-1))[:, 1:]
            return power[:, : power.shape[-1] // BINS * BINS].reshape(z.shape[0], BINS, -1).mean(axis=-1)

        return {"spectrum": np.mean(list(self.pool.map(binned, range(4))), axis=0).astype(np.float32)}

    def finalize(self):
        self.pool.shutdown(wait=True)


@step(inputs={"features": TensorSpec("FP32", [HIDDEN]), "spectrum": TensorSpec("FP32", [BINS])},
      outputs={"scores": TensorSpec("FP32", [CLASSES])})
class Head:
    """A softmax over ``features @ W`` plus the spectrum's first bins."""

    def initialize(self, config):
        self.weights = (np.random.default_rng(2).standard_normal((HIDDEN, CLASSES)) / np.sqrt(HIDDEN)).astype(
            np.float32)

    def execute(self, features, spectrum):
        logits = features @ self.weights + np.log1p(spectrum[:, :CLASSES])
        logits -= logits.max(axis=-1, keepdims=True)
        e = np.exp(logits)
        return {"scores": (e / e.sum(axis=-1, keepdims=True)).astype(np.float32)}


def make_threaded(name: str = "threaded") -> Pipeline:
    """``x -> standardize -> (project | spectrum) -> head -> scores``; batches of up to 4 requests."""
    p = Pipeline(name, inputs={"x": SIGNAL}, max_batch_size=4)
    z = p.add(standardize, x=p.input("x"))["z"]
    features = p.add(Project, name="project", z=z)["features"]
    spectrum = p.add(Spectrum, name="spectrum", z=z)["spectrum"]
    p.output("scores", p.add(Head, name="head", features=features, spectrum=spectrum)["scores"])
    return p


FRAME_SPEC = TensorSpec("FP32", [FRAME])


@step(inputs={"frame": FRAME_SPEC}, outputs={"smooth": FRAME_SPEC})
def smooth(frame):
    """Each value with half its neighbours' weight: a new 16 MiB tensor."""
    out = frame * np.float32(0.5)
    out[1:] += frame[:-1] * np.float32(0.25)
    out[:-1] += frame[1:] * np.float32(0.25)
    return {"smooth": out}


@step(inputs={"smooth": FRAME_SPEC}, outputs={"stats": TensorSpec("FP32", [4])})
def stats(smooth):
    return {"stats": np.array([smooth.mean(), smooth.std(), smooth.min(), smooth.max()], dtype=np.float32)}


@step(inputs={"smooth": FRAME_SPEC}, outputs={"histogram": TensorSpec("INT64", [BINS])})
def histogram(smooth):
    """Counts in ``BINS`` bins over -4..4 (the values outside in the end bins)."""
    bins = np.clip(((smooth + np.float32(4)) * np.float32(BINS / 8)).astype(np.int64), 0, BINS - 1)
    return {"histogram": np.bincount(bins, minlength=BINS).astype(np.int64)}


def make_tensor16(name: str = "tensor16") -> Pipeline:
    """``frame (16 MiB) -> smooth (16 MiB) -> (stats | histogram)``; one frame a request, no batching."""
    p = Pipeline(name, inputs={"frame": FRAME_SPEC}, max_batch_size=0)
    smoothed = p.add(smooth, frame=p.input("frame"))["smooth"]
    p.output("stats", p.add(stats, smooth=smoothed)["stats"])
    p.output("histogram", p.add(histogram, smooth=smoothed)["histogram"])
    return p


threaded = make_threaded()
tensor16 = make_tensor16()
