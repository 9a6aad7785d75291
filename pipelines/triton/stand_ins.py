"""Stand-ins for the models the bundled server has no backend for: its Triton (from
``nvidia-pytriton``) has only the Python backend, so an ``onnxruntime`` model is served by a
Python model that runs the same ONNX file with onnxruntime (``models/onnx_stand_in.py``).

The repository stays as written for a full Triton. The server is given a copy of it made of
links, with each stand-in written out in place of its model, in the server's work folder.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

from .models.onnx_stand_in import ONNX_FILE_PARAMETER, STAND_IN_PARAMETER

__all__ = ["ServedRepository", "StandIn", "stand_in_config", "stand_in_for"]

_ONNX_FILE = "model.onnx"  # Triton's onnxruntime backend's default_model_filename
_OWN_FILES = ("model.py", "serving")  # what a stand-in's version folder holds of its own


def stand_in_for(config: mc.ModelConfig) -> str | None:
    """What runs ``config``'s model in a stand-in on the bundled server (``"onnxruntime"``), or
    None when the bundled server serves it as it is (or cannot at all)."""
    if config.backend == "onnxruntime" or config.platform == "onnxruntime_onnx":
        return "onnxruntime"
    return None


@dataclass(frozen=True)
class StandIn:
    """A model of the repository that the bundled server serves through a Python stand-in."""

    model: str
    runtime: str
    model_file: str

    @property
    def short(self) -> str:
        """The label in a few words, for the lines that accompany the full one said elsewhere."""
        return f"a Python model running {self.model_file} with {self.runtime}"

    @property
    def label(self) -> str:
        """What the stand-in is, as its config, the server's log and the command line say it."""
        return (
            f"a Python model running {self.model_file} with {self.runtime}, standing in for the {self.runtime} "
            "backend that the bundled Triton server lacks (it has only the Python backend); the repository "
            f'keeps backend "{self.runtime}" for a full Triton, where this model\'s own timings belong'
        )


def stand_in_config(config: mc.ModelConfig, stand_in: StandIn) -> mc.ModelConfig:
    """``config`` as its stand-in's: the Python backend, on the CPU, labelled, with the same tensors,
    batching and instances, so the ensembles and BLS models that call it load unchanged."""
    out = mc.ModelConfig()
    out.CopyFrom(config)
    out.name = stand_in.model
    out.backend = "python"
    out.ClearField("platform")
    out.ClearField("default_model_filename")  # the Python backend would take it for its model.py
    out.optimization.ClearField("execution_accelerators")  # onnxruntime's (TensorRT, OpenVINO)
    if not out.optimization.ListFields():
        out.ClearField("optimization")
    for group in out.instance_group:
        if group.kind == mc.ModelInstanceGroup.KIND_GPU:  # the stand-in runs onnxruntime on the CPU
            group.kind = mc.ModelInstanceGroup.KIND_CPU
            group.ClearField("gpus")
    out.parameters[STAND_IN_PARAMETER].string_value = stand_in.label
    out.parameters[ONNX_FILE_PARAMETER].string_value = stand_in.model_file
    return out


def config_text(config: mc.ModelConfig) -> str:
    """``config.pbtxt`` text: identity first, then ``max_batch_size``, written even when 0
    (proto3 would drop it), then the rest."""
    head = mc.ModelConfig(name=config.name, platform=config.platform, backend=config.backend)
    rest = mc.ModelConfig()
    rest.CopyFrom(config)
    for name in ("name", "platform", "backend", "max_batch_size"):
        rest.ClearField(name)
    return (text_format.MessageToString(head) + f"max_batch_size: {int(config.max_batch_size)}\n"
            + text_format.MessageToString(rest))


class ServedRepository:
    """What the bundled server is given for ``repository``: ``folder``, holding a link to each of
    its entries, except the stand-ins (:attr:`stand_ins`), which are written out there.

    A model folder whose config names a backend the server lacks gets a stand-in; models added
    or rewritten later are seen again by :meth:`refresh` (``TritonServer.load_model`` calls it).
    """

    def __init__(self, repository: Path, folder: Path) -> None:
        self.repository = repository
        self.folder = folder
        self.stand_ins: dict[str, StandIn] = {}

    @classmethod
    def build(cls, repository: Path, folder: Path) -> ServedRepository | None:
        """The served copy of ``repository`` at ``folder``; None (and nothing written) when no
        model needs a stand-in, since the server is then given the repository itself."""
        if not any(_stand_in_of(Path(entry.path)) for entry in _entries(repository)):
            return None
        served = cls(repository, folder)
        folder.mkdir(parents=True)
        for entry in _entries(repository):
            served.refresh(entry.name)
        return served

    def refresh(self, name: str) -> StandIn | None:
        """Mirror the repository's entry ``name`` again (a link, or a stand-in written out); its stand-in, if any."""
        target = self.folder / name
        if target.is_symlink() or target.is_file():
            target.unlink()
        elif target.exists():
            shutil.rmtree(target)
        self.stand_ins.pop(name, None)
        source = self.repository / name
        if not os.path.lexists(source):
            return None
        stand_in = _stand_in_of(source)
        if stand_in is None:
            target.symlink_to(source, target_is_directory=source.is_dir())
            return None
        _write_stand_in(source, target, stand_in)
        self.stand_ins[name] = stand_in
        return stand_in


def _entries(repository: Path) -> list[os.DirEntry[str]]:
    return sorted(os.scandir(repository), key=lambda entry: entry.name)


def _read_config(model_dir: Path) -> mc.ModelConfig | None:
    try:
        return text_format.Parse((model_dir / "config.pbtxt").read_text(encoding="utf-8"), mc.ModelConfig())
    except (OSError, UnicodeDecodeError, text_format.ParseError):
        return None  # not a model, or one Triton will refuse with its own words


def _stand_in_of(model_dir: Path) -> StandIn | None:
    config = _read_config(model_dir) if model_dir.is_dir() else None
    runtime = stand_in_for(config) if config is not None else None
    if config is None or runtime is None:
        return None
    return StandIn(model=model_dir.name, runtime=runtime, model_file=config.default_model_filename or _ONNX_FILE)


def _write_stand_in(source: Path, target: Path, stand_in: StandIn) -> None:
    """The stand-in's folder: its config, and in each version folder its ``model.py``, the
    ``serving/`` package, and links to the model's own files (the ONNX file, its external data)."""
    config = _read_config(source)
    assert config is not None
    target.mkdir()
    (target / "config.pbtxt").write_text(config_text(stand_in_config(config, stand_in)), encoding="utf-8")
    code = resources.files("pipelines.triton.models").joinpath("onnx_stand_in.py").read_bytes()
    serving = [m for m in resources.files("pipelines.serving").iterdir() if m.name.endswith(".py")]
    for entry in _entries(source):
        if entry.name == "config.pbtxt":
            continue
        if not (entry.name.isdigit() and entry.is_dir()):
            (target / entry.name).symlink_to(entry.path, target_is_directory=entry.is_dir())
            continue
        version = target / entry.name
        (version / "serving").mkdir(parents=True)
        (version / "model.py").write_bytes(code)
        for module in serving:
            (version / "serving" / module.name).write_bytes(module.read_bytes())
        for item in _entries(Path(entry.path)):
            if item.name not in _OWN_FILES:
                (version / item.name).symlink_to(item.path, target_is_directory=item.is_dir())
