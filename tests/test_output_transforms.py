"""Output transforms (temperature, log-softmax, top-k over the last dimension, the mass outside the
top-k, dtype) against the in-process model, through a real server; they run before the
device-to-host copy; `module:factory` arguments."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from teacher_server import ServerConfig
from teacher_server import instance as instance_mod
from teacher_server.cli import build_parser, config_from_args, parse_model_args
from teacher_server.instance import ModelInstance
from teacher_server.model import ModelLoadError, load_model
from teacher_server.outputs import NamedTensor, OutputTransform
from teacher_server.spec import SpecError, TensorSpec
from teacher_server.work import Work
from tests.models import tiny_lm
from tests.servers import ServerThread

LM = "tests.models:tiny_lm"
VOCAB = 41
ARGS: dict[str, Any] = {"vocab": VOCAB, "hidden": 12, "seed": 3, "scale": 2.0}


@pytest.fixture(scope="module")
def lm() -> torch.nn.Module:
    return tiny_lm(**ARGS).eval()


@pytest.fixture(scope="module")
def lm_server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model=LM, name="lm", device="cpu", model_args=ARGS)
    with ServerThread(cfg) as s:
        yield s


@pytest.fixture()
def client(lm_server: ServerThread) -> Iterator[tg.InferenceServerClient]:
    c = tg.InferenceServerClient(lm_server.url)
    yield c
    c.close()


def _tokens(b: int, t: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, VOCAB, size=(b, t), dtype=np.int64)


def _input(x: np.ndarray) -> tg.InferInput:
    i = tg.InferInput("TOKENS", list(x.shape), "INT64")
    i.set_data_from_numpy(x)
    return i


def _logits(lm: torch.nn.Module, x: np.ndarray) -> torch.Tensor:
    with torch.inference_mode():
        out: torch.Tensor = lm(torch.from_numpy(x))
    return out


def test_topk_logprobs_at_temperature_match_the_in_process_model(
        client: tg.InferenceServerClient, lm: torch.nn.Module) -> None:
    x = _tokens(3, 7)
    result = client.infer("lm", [_input(x)],
                          parameters={"logprobs": True, "temperature": 2.0, "top_k": 5, "topk_tail": True})
    want = torch.topk(torch.log_softmax(_logits(lm, x) / 2.0, dim=-1), 5, dim=-1)
    values = result.as_numpy("LOGITS_TOPK_VALUES")
    indices = result.as_numpy("LOGITS_TOPK_INDICES")
    tail = result.as_numpy("LOGITS_TOPK_TAIL")
    assert values.dtype == np.float32 and values.shape == (3, 7, 5)
    assert indices.dtype == np.int32 and indices.shape == (3, 7, 5)
    assert tail.dtype == np.float32 and tail.shape == (3, 7)
    assert np.allclose(values, want.values.numpy(), atol=1e-5)
    assert np.array_equal(indices, want.indices.numpy())
    assert np.allclose(tail, 1.0 - np.exp(values).sum(axis=-1), atol=1e-5)
    assert np.allclose(tail, 1.0 - want.values.exp().sum(-1).numpy(), atol=1e-5)
    assert (tail > 0).all() and tail.mean() > 0.05  # the test's logits leave real mass outside the top 5


def test_tail_without_logprobs_is_the_softmax_mass_outside_the_raw_topk(
        client: tg.InferenceServerClient, lm: torch.nn.Module) -> None:
    x = _tokens(2, 4, seed=1)
    result = client.infer("lm", [_input(x)], parameters={"top_k": 3, "topk_tail": True, "output_dtype": "FP16"})
    logits = _logits(lm, x)
    want = torch.topk(logits, 3, dim=-1)
    assert result.get_output("LOGITS_TOPK_VALUES").datatype == "FP16"
    assert result.get_output("LOGITS_TOPK_TAIL").datatype == "FP16"
    assert np.allclose(result.as_numpy("LOGITS_TOPK_VALUES"), want.values.numpy(), rtol=1e-3, atol=1e-2)
    probs = torch.softmax(logits, dim=-1)
    want_tail = 1.0 - probs.gather(-1, want.indices).sum(-1)
    assert np.allclose(result.as_numpy("LOGITS_TOPK_TAIL").astype(np.float32), want_tail.numpy(), atol=2e-3)


def test_full_logprobs_in_bf16(client: tg.InferenceServerClient, lm: torch.nn.Module) -> None:
    x = _tokens(2, 3, seed=2)
    out = tg.InferRequestedOutput("LOGITS")
    out._get_tensor().parameters["logprobs"].bool_param = True
    out._get_tensor().parameters["output_dtype"].string_param = "BF16"
    result = client.infer("lm", [_input(x)], outputs=[out])
    assert result.get_output("LOGITS").datatype == "BF16"
    got = result.as_numpy("LOGITS").astype(np.float32)
    want = torch.log_softmax(_logits(lm, x), dim=-1).to(torch.bfloat16).float().numpy()
    assert got.shape == (2, 3, VOCAB) and np.allclose(got, want, rtol=1e-2, atol=1e-2)


def test_two_dimensional_outputs_take_the_same_transforms() -> None:
    cfg = ServerConfig(model="tests.models:affine", name="affine", device="cpu",
                       logprobs=True, temperature=0.5, top_k=2, topk_tail=True)
    from tests.models import affine
    model = affine().eval()
    x = np.random.default_rng(4).standard_normal((5, 8), dtype=np.float32)
    with ServerThread(cfg) as s:
        c = tg.InferenceServerClient(s.url)
        try:
            inp = tg.InferInput("X", [5, 8], "FP32")
            inp.set_data_from_numpy(x)
            by_default = c.infer("affine", [inp])  # the server's --logprobs/--temperature/--top-k/--topk-tail
            raw = c.infer("affine", [inp], parameters={"logprobs": False, "top_k": 0, "temperature": 1.0})
        finally:
            c.close()
    with torch.inference_mode():
        logits = model(torch.from_numpy(x))
    want = torch.topk(torch.log_softmax(logits / 0.5, dim=-1), 2, dim=-1)
    assert np.allclose(by_default.as_numpy("Y_TOPK_VALUES"), want.values.numpy(), atol=1e-5)
    assert np.array_equal(by_default.as_numpy("Y_TOPK_INDICES"), want.indices.numpy())
    assert np.allclose(by_default.as_numpy("Y_TOPK_TAIL"), 1 - np.exp(want.values.numpy()).sum(-1), atol=1e-5)
    assert np.allclose(raw.as_numpy("Y"), logits.numpy(), atol=1e-5)


@pytest.mark.parametrize(("params", "message"), [
    ({"temperature": 0.0}, "temperature must be a finite number > 0"),
    ({"temperature": -2.0}, "temperature must be a finite number > 0"),
    ({"temperature": "hot"}, "temperature must be a finite number > 0"),
    ({"logprobs": "yes"}, "logprobs must be a boolean"),
    ({"topk_tail": 1}, "topk_tail must be a boolean"),
    ({"topk_tail": True}, "ask for top_k too"),
])
def test_bad_transform_parameters_are_invalid_argument(
        client: tg.InferenceServerClient, params: dict[str, object], message: str) -> None:
    with pytest.raises(InferenceServerException, match=message) as err:
        client.infer("lm", [_input(_tokens(1, 2))], parameters=params)
    assert err.value.status() == "StatusCode.INVALID_ARGUMENT"


def test_server_defaults_are_checked() -> None:
    with pytest.raises(SpecError, match="--temperature must be a finite number > 0"):
        ServerConfig(model=LM, temperature=0.0)


# ---- the transforms run on the model's device, before the one copy to the host -----------------
def test_only_the_reduced_tensors_are_copied_to_the_host(monkeypatch: pytest.MonkeyPatch) -> None:
    model = load_model(LM, device="cpu", model_args=ARGS)
    copied: list[tuple[tuple[int, ...], int]] = []
    real_copy = instance_mod.copy_to_host

    def counting_copy(t: torch.Tensor) -> torch.Tensor:
        copied.append((tuple(t.shape), t.numel() * t.element_size()))
        return real_copy(t)

    monkeypatch.setattr(instance_mod, "copy_to_host", counting_copy)
    inst = ModelInstance(model, 0, max_batch_size=8)
    try:
        want = [OutputTransform("LOGITS", None, 4, True, 2.0, True)]
        tokens = [torch.from_numpy(_tokens(b, 6, seed=b)) for b in (2, 3)]
        result = inst.run([Work([t], t.shape[0], want) for t in tokens])
        # One batch of 5 x 6 positions: values fp32 + indices int32 + tail fp32, never 41-wide logits;
        # then whether each row's outputs are finite, one bool a row.
        assert copied == [((5, 6, 4), 5 * 6 * 4 * 4), ((5, 6, 4), 5 * 6 * 4 * 4), ((5, 6), 5 * 6 * 4), ((5,), 5)]
        assert [[(n, s) for n, _, s, _ in r] for r in result.per_request] == [
            [("LOGITS_TOPK_VALUES", [b, 6, 4]), ("LOGITS_TOPK_INDICES", [b, 6, 4]), ("LOGITS_TOPK_TAIL", [b, 6])]
            for b in (2, 3)]

        copied.clear()  # requests wanting different transforms: each one's reduced slices only
        other = [OutputTransform("LOGITS", "FP16", 2)]
        inst.run([Work([tokens[0]], 2, want), Work([tokens[1]], 3, other)])
        assert copied == [((2, 6, 4), 2 * 6 * 4 * 4), ((2, 6, 4), 2 * 6 * 4 * 4), ((2, 6), 2 * 6 * 4),
                          ((3, 6, 2), 3 * 6 * 2 * 2), ((3, 6, 2), 3 * 6 * 2 * 4), ((5,), 5)]
    finally:
        inst.close()


def test_the_transform_sees_the_tensor_on_the_models_device(monkeypatch: pytest.MonkeyPatch) -> None:
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = load_model(LM, device=device, model_args=ARGS)
    seen: list[torch.device] = []
    copied: list[torch.device] = []
    real_transform, real_copy = instance_mod.transform_output, instance_mod.copy_to_host

    def watch_transform(t: torch.Tensor, spec: TensorSpec, want: OutputTransform) -> list[NamedTensor]:
        seen.append(t.device)
        return real_transform(t, spec, want)

    def watch_copy(t: torch.Tensor) -> torch.Tensor:
        copied.append(t.device)
        out = real_copy(t)
        assert out.device.type == "cpu"
        return out

    monkeypatch.setattr(instance_mod, "transform_output", watch_transform)
    monkeypatch.setattr(instance_mod, "copy_to_host", watch_copy)
    inst = ModelInstance(model, 0, max_batch_size=4)
    try:
        t = torch.from_numpy(_tokens(2, 3))
        inst.run([Work([t], 2, [OutputTransform("LOGITS", None, 3)])])
    finally:
        inst.close()
    assert seen == [model.device] and copied == [model.device, model.device, model.device]  # values, indices, finite


# ---- factory arguments ---------------------------------------------------------------------------
def test_model_args_parse_as_json_when_they_parse() -> None:
    assert parse_model_args(["vocab=37", "scale=0.5", "name=abc", "flag=true", "dims=[1, 2]", 'q="7"']) == {
        "vocab": 37, "scale": 0.5, "name": "abc", "flag": True, "dims": [1, 2], "q": "7"}
    with pytest.raises(SpecError, match="expected KEY=VALUE"):
        parse_model_args(["vocab"])
    with pytest.raises(SpecError, match="given twice"):
        parse_model_args(["vocab=3", "vocab=4"])


def test_model_args_reach_the_factory_through_the_cli(tmp_path: Path) -> None:
    args = build_parser().parse_args(["--model", LM, "--device", "cpu", "--port", "0",
                                      "--model-arg", "vocab=23", "--model-arg", "seed=5"])
    cfg = config_from_args(args)
    assert cfg.model_args == {"vocab": 23, "seed": 5}
    with ServerThread(cfg) as s:
        c = tg.InferenceServerClient(s.url)
        try:
            meta = c.get_model_metadata("teacher", as_json=True)
        finally:
            c.close()
    assert meta["outputs"] == [{"name": "LOGITS", "datatype": "FP32", "shape": ["-1", "-1", "23"]}]


def test_a_factory_rejecting_an_argument_names_it() -> None:
    with pytest.raises(ModelLoadError, match=r"rejects --model-arg vocabulary: .*tiny_lm\(vocab"):
        load_model(LM, device="cpu", model_args={"vocab": 5, "vocabulary": 5})
    with pytest.raises(ModelLoadError, match="refused --model-arg vocab=1: vocab must be at least 2"):
        load_model(LM, device="cpu", model_args={"vocab": 1})


def test_transform_parameters_over_http_and_the_tail_follows_its_outputs_binary_choice(
        lm: torch.nn.Module) -> None:
    import tritonclient.http as th

    cfg = ServerConfig(model=LM, name="lm", device="cpu", model_args=ARGS, http_port=0)
    x = _tokens(2, 5, seed=6)
    with ServerThread(cfg) as s:
        assert s.server is not None and s.server.http_port is not None
        c = th.InferenceServerClient(f"127.0.0.1:{s.server.http_port}", network_timeout=60.0)
        try:
            inp = th.InferInput("TOKENS", list(x.shape), "INT64")
            inp.set_data_from_numpy(x)
            out = th.InferRequestedOutput("LOGITS", binary_data=True)
            result = c.infer("lm", [inp], outputs=[out],
                             parameters={"logprobs": True, "temperature": 0.5, "top_k": 3, "topk_tail": True})
        finally:
            c.close()
    want = torch.topk(torch.log_softmax(_logits(lm, x) / 0.5, dim=-1), 3, dim=-1)
    assert np.allclose(result.as_numpy("LOGITS_TOPK_VALUES"), want.values.numpy(), atol=1e-5)
    assert np.array_equal(result.as_numpy("LOGITS_TOPK_INDICES"), want.indices.numpy())
    assert np.allclose(result.as_numpy("LOGITS_TOPK_TAIL"), 1 - want.values.exp().sum(-1).numpy(), atol=1e-5)
    assert all("binary_data_size" in o["parameters"] for o in result.get_response()["outputs"])
