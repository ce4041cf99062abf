"""Loading a teacher: from what the command line names to a module ready to run on its device.

A teacher comes from one of four sources, all loaded only from what the command line names:
`package.module:factory` (a callable returning an `nn.Module`, called with the --model-arg
keyword arguments), a TorchScript file, a `torch.export` `.pt2` file, or `hf:DIR`, a Hugging Face
`transformers` model saved in a local directory (teacher_server.hf_model). Its tensors are
declared by flags, a JSON config, or an `io_spec` attribute (a `ModelIO`) on the module;
undeclared outputs are inferred by a warm-up forward.
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from protos.kserve import datatype_of
from teacher_server.hf_model import HFLoadError, is_hf_source, load_hf_teacher
from teacher_server.spec import FLOAT_OUTPUT_DTYPES, ModelIO, SpecError, TensorSpec

log = logging.getLogger(__name__)

__all__ = ["FLOAT_OUTPUT_DTYPES", "LoadedModel", "ModelLoadError", "import_factory", "load_model", "resolve_device",
           "with_index"]


class ModelLoadError(RuntimeError):
    """The model could not be loaded or does not run on its declared inputs."""


@dataclass
class LoadedModel:
    """A module ready to serve: on its device, in eval mode, with its declared I/O."""

    module: Callable[..., Any]
    io: ModelIO
    device: torch.device
    compute_dtype: torch.dtype = torch.float32
    autocast: bool = True  # False: the weights are already in compute_dtype (a Hugging Face teacher)

    def __post_init__(self) -> None:
        self.device = with_index(torch.device(self.device))

    def forward(self, inputs: Sequence[torch.Tensor | None]) -> list[torch.Tensor]:
        """Run the module and return its outputs in declared order (callers hold inference_mode)."""
        autocast = self.autocast and self.compute_dtype != torch.float32
        with torch.autocast(self.device.type, dtype=self.compute_dtype, enabled=autocast):
            out = self.module(*inputs)
        return _as_output_list(out, self.io.outputs)


def _as_output_list(out: Any, declared: Sequence[TensorSpec]) -> list[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        outs = [out]
    elif isinstance(out, dict):
        if declared:
            missing = [s.name for s in declared if s.name not in out]
            if missing:
                raise ModelLoadError(f"model returned keys {sorted(out)}, missing declared outputs {missing}")
            outs = [out[s.name] for s in declared]
        else:
            outs = list(out.values())
    elif isinstance(out, (tuple, list)):
        outs = list(out)
    else:
        raise ModelLoadError(f"model returned {type(out).__name__}; expected a tensor, tuple or dict of tensors")
    if declared and len(outs) != len(declared):
        raise ModelLoadError(f"model returned {len(outs)} outputs, {len(declared)} declared")
    return outs


def _output_names(out: Any) -> list[str]:
    if isinstance(out, dict):
        return [str(k) for k in out]
    n = 1 if isinstance(out, torch.Tensor) else len(out)
    return [f"OUTPUT{i}" for i in range(n)]


def import_factory(ref: str) -> Callable[..., Any]:
    """Resolve `package.module:callable`."""
    mod_name, _, attr = ref.partition(":")
    if not mod_name or not attr:
        raise ModelLoadError(f"bad model reference {ref!r}; expected package.module:factory or a model file")
    try:
        mod = importlib.import_module(mod_name)
    except ImportError as e:
        raise ModelLoadError(f"cannot import {mod_name!r} for model {ref!r}: {e} (is the directory it is in on "
                             "the import path? pass --model-path DIR, or model_path= to serve())") from e
    obj: Any = mod
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ModelLoadError(f"{mod_name!r} has no attribute {attr!r} (model {ref!r})")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ModelLoadError(f"{ref!r} is not callable; it must return an nn.Module")
    factory: Callable[..., Any] = obj
    return factory


def call_factory(ref: str, factory: Callable[..., Any], model_args: Mapping[str, Any]) -> Any:
    """Call a `module:factory` with the --model-arg keyword arguments; a factory that rejects them
    is a ModelLoadError naming the argument and the factory's signature."""
    try:
        sig: inspect.Signature | None = inspect.signature(factory)
    except (TypeError, ValueError):
        sig = None  # builtins and some C callables have no signature: let the call decide
    if sig is not None and model_args:
        try:
            sig.bind(**model_args)
        except TypeError as e:
            takes_any = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
            unknown = [] if takes_any else [k for k in model_args if k not in sig.parameters]
            names = ", ".join(unknown or sorted(model_args))
            raise ModelLoadError(
                f"factory {ref!r} rejects --model-arg {names}: {e}; its signature is {ref.partition(':')[2]}{sig}"
            ) from None
    if not model_args:
        return factory()
    try:
        return factory(**model_args)
    except (TypeError, ValueError) as e:
        given = ", ".join(f"{k}={v!r}" for k, v in model_args.items())
        raise ModelLoadError(f"factory {ref!r} refused --model-arg {given}: {e}") from e


def _refuse_static_batch(program: Any, source: str) -> None:
    """A program exported without a dynamic batch dimension runs one batch size only; without this
    check the first other batch fails deep in torch with 'Guard failed: x.size()[0] == 2'."""
    user = set(program.graph_signature.user_inputs)
    for node in program.graph.nodes:
        val = node.meta.get("val") if node.op == "placeholder" and node.name in user else None
        if isinstance(val, torch.Tensor) and val.dim() >= 1 and isinstance(val.shape[0], int):
            raise ModelLoadError(
                f"exported program {source}: input {node.name!r} has a fixed batch size of {val.shape[0]}, but "
                "the server sends batches of any size; export with a dynamic batch dimension and an example "
                "batch of 2 or more: batch = torch.export.Dim('batch'); torch.export.export(model, (x,), "
                f"dynamic_shapes={{{node.name!r}: {{0: batch}}}})")


def _load_module(source: str, device: torch.device, model_args: Mapping[str, Any] | None = None) -> Any:
    path = Path(source)
    if model_args and (path.suffix in _FILE_SUFFIXES or (path.is_file() and ":" not in source)):
        raise ModelLoadError(f"--model-arg applies to a module:factory; {source} is a model file")
    if path.suffix == ".pt2":
        if not path.is_file():
            raise ModelLoadError(f"exported program {source} does not exist")
        # torch.export.load reads a zip of graph + weights; it does not unpickle arbitrary objects.
        program = torch.export.load(str(path))
        _refuse_static_batch(program, source)
        return program.module().to(device)
    if path.suffix in _FILE_SUFFIXES or (path.is_file() and ":" not in source):
        if not path.is_file():
            raise ModelLoadError(f"TorchScript file {source} does not exist")
        try:
            return torch.jit.load(str(path), map_location=device)
        except RuntimeError as e:
            raise ModelLoadError(
                f"{source} is not a TorchScript archive ({e}); save it with torch.jit.save or serve a "
                "module:factory instead"
            ) from e
    module = call_factory(source, import_factory(source), model_args or {})
    if not isinstance(module, torch.nn.Module):
        raise ModelLoadError(f"factory {source!r} returned {type(module).__name__}, not a torch.nn.Module")
    return module.to(device)


def _eval(module: Any) -> None:
    try:
        module.eval()
    except (NotImplementedError, RuntimeError, AttributeError):
        pass  # exported programs have no train/eval switch


_FILE_SUFFIXES = frozenset({".pt2", ".pt", ".pth", ".ts", ".torchscript", ".jit"})


def with_index(device: torch.device, current: int | None = None) -> torch.device:
    """`device` as its tensors report it: an accelerator named without an index (``cuda``) is the
    current one (``cuda:0``), so ``tensor.device == model.device`` holds; cpu stays ``cpu``.
    `current`: that index (default: asked of torch, for the device's type)."""
    if device.type == "cpu" or device.index is not None:
        return device
    if current is None:
        module = getattr(torch, device.type, None)
        try:
            current = int(module.current_device())
        except (AttributeError, AssertionError, RuntimeError):  # no such backend here: left as named
            return device
    return torch.device(device.type, current)


def resolve_device(device: str | None) -> torch.device:
    """`None`/'auto' → cuda when available, else cpu; an accelerator always with its index (``cuda:0``)."""
    if device in (None, "", "auto"):
        return with_index(torch.device("cuda" if torch.cuda.is_available() else "cpu"))
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError(f"device {device} requested but CUDA is not available; use --device cpu")
    return with_index(dev)


def load_model(
    source: str,
    *,
    device: str | torch.device | None = None,
    io: ModelIO | None = None,
    compute_dtype: str = "FP32",
    model_args: Mapping[str, Any] | None = None,
) -> LoadedModel:
    """Load, move to device, switch to eval, resolve the I/O declaration and warm up once.

    `model_args` are keyword arguments for a `module:factory` (--model-arg KEY=VALUE), so a
    factory is configured on the command line rather than through environment variables."""
    dev = device if isinstance(device, torch.device) else resolve_device(device)
    if compute_dtype not in FLOAT_OUTPUT_DTYPES:
        raise SpecError(f"compute dtype {compute_dtype!r}; use one of {', '.join(FLOAT_OUTPUT_DTYPES)}")
    hf = is_hf_source(source)
    if hf:
        if model_args:
            raise ModelLoadError(f"--model-arg applies to a module:factory, not to {source}")
        try:
            module: Any = load_hf_teacher(source, dev, FLOAT_OUTPUT_DTYPES[compute_dtype])
        except HFLoadError as e:
            raise ModelLoadError(str(e)) from e
    else:
        if os.path.isabs(source) or source.startswith("."):
            source = str(Path(source).resolve())
        module = _load_module(source, dev, model_args)
    _eval(module)
    declared = io or getattr(module, "io_spec", None)
    if declared is None or not declared.inputs:
        raise SpecError(
            f"model {source!r} declares no inputs: pass --input NAME:DATATYPE:SHAPE (and --output), "
            "a --model-config JSON file, or set an `io_spec` (teacher_server.ModelIO) on the module"
        )
    module = _cuda_layout(module, declared, dev)
    model = LoadedModel(module, declared, dev, FLOAT_OUTPUT_DTYPES[compute_dtype], autocast=not hf)
    model.io = _probe(model)
    return model


def _cuda_layout(module: Any, io: ModelIO, device: torch.device) -> Any:
    """On CUDA, what the best plain PyTorch does for a fixed-shape image model: cuDNN picks its
    fastest convolution per shape (shapes repeat batch after batch), and the weights go
    channels_last, the layout tensor cores want (convolutions then take NCHW inputs as they come).
    A TorchScript module keeps its layout: it cannot be converted after scripting."""
    if device.type != "cuda":
        return module
    torch.backends.cudnn.benchmark = True
    images = any(len(s.shape) == 3 and -1 not in s.shape for s in io.inputs)
    if images and isinstance(module, torch.nn.Module) and not isinstance(module, torch.jit.ScriptModule):
        module = module.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # runtime kwarg, not in the stubs
    return module


def _probe(model: LoadedModel) -> ModelIO:
    """One forward on zeros: proves the model runs on its declaration and fills in undeclared outputs."""
    xs = [
        torch.zeros((2, *[1 if d == -1 else d for d in s.shape]), dtype=s.torch_dtype, device=model.device)
        for s in model.io.inputs
    ]
    try:
        with torch.inference_mode():
            autocast = model.autocast and model.compute_dtype != torch.float32
            with torch.autocast(model.device.type, dtype=model.compute_dtype, enabled=autocast):
                raw = model.module(*xs)
            outs = _as_output_list(raw, model.io.outputs)
    except ModelLoadError:
        raise
    except Exception as e:
        raise ModelLoadError(f"model failed on a warm-up batch shaped like its declared inputs: {e}") from e
    for o in outs:
        if not isinstance(o, torch.Tensor) or o.dim() < 1 or o.shape[0] != 2:
            raise ModelLoadError("every model output must be a tensor whose first dimension is the batch")
    if model.io.outputs:
        for spec, o in zip(model.io.outputs, outs, strict=True):
            if not spec.matches(tuple(o.shape[1:])):
                raise ModelLoadError(
                    f"output {spec.name!r} declared with shape {list(spec.shape)} but the model returns "
                    f"{list(o.shape[1:])} per sample"
                )
        return model.io
    names = _output_names(raw)
    specs = tuple(
        TensorSpec(n, datatype_of(o.float().dtype if autocast else o.dtype).name, tuple(o.shape[1:]))
        for n, o in zip(names, outs, strict=True)
    )
    log.info("outputs inferred from a warm-up forward: %s", ", ".join(f"{s.name}{list(s.shape)}" for s in specs))
    return ModelIO(model.io.inputs, specs)
