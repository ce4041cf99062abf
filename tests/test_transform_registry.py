"""The output-transform registry: the parameters it declares are the server's flags and defaults,
near-misses of them are refused by name through a real server (gRPC and HTTP) while foreign
parameters stay ignored, and chunked transforms equal whole ones."""

from __future__ import annotations

import argparse
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
import tritonclient.http as th
from tritonclient.utils import InferenceServerException

from protos.outputs import DERIVED, DROP_CLASSES, PROBS, flag_output
from teacher_server import ServerConfig
from teacher_server.cli import build_parser
from teacher_server.near_miss import near_miss
from teacher_server.outputs import OutputContext, OutputDefaults, OutputTransform, transform_output
from teacher_server.spec import TensorSpec
from teacher_server.transform_rows import Rows
from teacher_server.transforms import PARAMETERS, REGISTRY, flag_transform, register, unregister
from tests.models import tiny_lm
from tests.servers import ServerThread

VOCAB = 41
ARGS: dict[str, Any] = {"vocab": VOCAB, "hidden": 12, "seed": 3, "scale": 2.0}


@pytest.fixture(scope="module")
def server() -> Iterator[ServerThread]:
    cfg = ServerConfig(model="tests.models:tiny_lm", name="lm", device="cpu", model_args=ARGS, http_port=0)
    with ServerThread(cfg) as s:
        yield s


def _tokens() -> np.ndarray:
    return np.random.default_rng(0).integers(0, VOCAB, size=(2, 5), dtype=np.int64)


# ---- the registry is the source of the server's output flags ------------------------------------
def test_the_cli_output_flags_are_the_registrys() -> None:
    actions = {a.dest: a for a in build_parser()._actions}
    declared = [p for p in PARAMETERS.values() if p.server_default]
    assert {p.flag for p in declared} == {"--top-k", "--logprobs", "--temperature", "--topk-tail", "--output-dtype"}
    for p in declared:
        assert p.flag in actions[p.dest].option_strings
        assert actions[p.dest].default == (False if p.type is bool else p.default), p.name


def test_a_parser_built_from_the_registry_gives_the_server_defaults() -> None:
    parser = argparse.ArgumentParser()
    for p in PARAMETERS.values():
        if p.server_default:
            parser.add_argument(p.flag, **p.argparse_options())
    args = parser.parse_args(["--top-k", "3", "--logprobs", "--output-dtype", "fp16", "--temperature", "2"])
    defaults = OutputDefaults.from_options({p.name: getattr(args, p.dest) for p in PARAMETERS.values()
                                            if p.server_default})
    assert defaults == OutputDefaults("FP16", 3, True, 2.0)
    assert defaults.transform("LOGITS") == OutputTransform("LOGITS", "FP16", 3, True, 2.0, False)
    with pytest.raises(SystemExit):
        parser.parse_args(["--output-dtype", "fp64"])


def test_every_entry_names_its_outputs_and_parameters() -> None:
    names = [t.name for t in REGISTRY]
    assert names == ["temperature", "logprobs", "top_k", "topk_tail", "token_logprobs", "token_ranks", "score_ids",
                     "output_dtype"]
    suffixes = [o.suffix for t in REGISTRY for o in t.outputs]
    assert suffixes == ["_TOPK_VALUES", "_TOPK_INDICES", "_TOPK_TAIL", "_TOKEN_LOGPROBS", "_TOKEN_RANKS",
                        "_SCORED_LOGPROBS"]
    assert [t.name for t in REGISTRY if t.reduces] == ["top_k", "token_logprobs", "token_ranks", "score_ids"]
    for p in PARAMETERS.values():
        assert p.check(p.default if p.default is not None else "FP32") is not None or p.default is None
    with pytest.raises(TypeError, match="unknown transform parameters"):
        OutputTransform("LOGITS", top_p=0.5)
    assert OutputTransform("LOGITS", token_logprobs=True).token_logprobs


# ---- near-misses are refused by name, foreign parameters ignored --------------------------------
@pytest.mark.parametrize(("sent", "meant"), [
    ("topk", "top_k"), ("log_probs", "logprobs"), ("outputdtype", "output_dtype"), ("Top-K", "top_k"),
    ("temprature", "temperature"), ("token_logprob", "token_logprobs"), ("TOPK_TAIL", "topk_tail"),
    ("priorty", "priority"),
])
def test_near_misses(sent: str, meant: str) -> None:
    assert near_miss(sent) == meant


@pytest.mark.parametrize("foreign", [
    "top_p", "sequence_id", "sequence_start", "binary_data_output", "triton_enable_empty_final_response", "seed",
    "max_tokens", "top_k", "logprobs", "x" * 100,
])
def test_foreign_and_own_names_are_not_near_misses(foreign: str) -> None:
    assert near_miss(foreign) is None


def test_near_misses_are_invalid_argument_over_grpc(server: ServerThread) -> None:
    x = _tokens()
    inp = tg.InferInput("TOKENS", list(x.shape), "INT64")
    inp.set_data_from_numpy(x)
    with tg.InferenceServerClient(server.url) as c:
        with pytest.raises(InferenceServerException, match=r"request: unknown parameters 'log_probs' \(did you mean "
                           r"'logprobs'\?\), 'topk' \(did you mean 'top_k'\?\)") as err:
            c.infer("lm", [inp], parameters={"topk": 4, "log_probs": True})
        assert err.value.status() == "StatusCode.INVALID_ARGUMENT"
        out = tg.InferRequestedOutput("LOGITS")
        out._get_tensor().parameters["outputdtype"].string_param = "FP16"
        with pytest.raises(InferenceServerException, match="output 'LOGITS': unknown parameter 'outputdtype' "
                                                           r"\(did you mean 'output_dtype'\?\)"):
            c.infer("lm", [inp], outputs=[out])
        raw = c.infer("lm", [inp], sequence_id=7, parameters={"top_p": 0.9, "custom_flag": True})
    assert raw.as_numpy("LOGITS").shape == (2, 5, VOCAB)


def test_near_misses_are_400_over_http(server: ServerThread) -> None:
    assert server.server is not None and server.server.http_port is not None
    x = _tokens()
    inp = th.InferInput("TOKENS", list(x.shape), "INT64")
    inp.set_data_from_numpy(x)
    c = th.InferenceServerClient(f"127.0.0.1:{server.server.http_port}", network_timeout=60.0)
    try:
        with pytest.raises(InferenceServerException, match="did you mean 'logprobs'") as err:
            c.infer("lm", [inp], parameters={"log_probs": True})
        assert err.value.status() == "400"
        raw = c.infer("lm", [inp], parameters={"top_p": 0.9})
    finally:
        c.close()
    assert raw.as_numpy("LOGITS").shape == (2, 5, VOCAB)


# ---- chunks of positions ------------------------------------------------------------------------
@pytest.mark.parametrize("want", [
    OutputTransform("LOGITS", "FP16", 4, True, 2.0, True),
    OutputTransform("LOGITS", None, 0, True, 0.5),
    OutputTransform("LOGITS", None, 3, False, 1.0, True),
])
def test_transforms_in_chunks_equal_the_whole(want: OutputTransform) -> None:
    model = tiny_lm(**ARGS).eval()
    with torch.inference_mode():
        logits = model(torch.from_numpy(np.random.default_rng(1).integers(0, VOCAB, size=(3, 9))))
    spec = TensorSpec("LOGITS", "FP32", (-1, VOCAB), per_position=True)
    cut = logits.narrow(1, 0, 7)  # a request cut back to its length: no flat view
    for x in (logits, cut):
        whole = transform_output(x, spec, want)
        chunked = transform_output(x, spec, want, OutputContext(chunk_bytes=2 * VOCAB * 4))
        assert [(n, t.shape, t.dtype) for n, t in whole] == [(n, t.shape, t.dtype) for n, t in chunked]
        for (name, a), (_, b) in zip(whole, chunked, strict=True):
            assert torch.equal(a, b), name


@pytest.mark.parametrize("want", [
    OutputTransform("LOGITS", "FP16", 4, True, 2.0, True),
    OutputTransform("LOGITS", None, 3, True, 1.0, True),
    OutputTransform("LOGITS", None, 3, False, 0.5, True),
    OutputTransform("LOGITS", "BF16", 0, True, 1.0),
])
def test_a_bf16_output_is_transformed_in_fp32_and_left_unchanged(want: OutputTransform) -> None:
    """A bf16 forward pass is read in fp32 only where a transform reads it (the chunk is not
    copied up front, and the temperature divides a copy in place): the answers equal the same
    math on the upcast logits, whole and in chunks, and the model's tensor is never written."""
    logits = torch.randn(3, 9, VOCAB, generator=torch.Generator().manual_seed(5)).mul_(4).to(torch.bfloat16)
    before = logits.clone()
    spec = TensorSpec("LOGITS", "BF16", (-1, VOCAB), per_position=True)
    x = logits.float() / want.temperature
    if want.logprobs:
        x = torch.log_softmax(x, dim=-1)
    sent = {"FP16": torch.float16, "BF16": torch.bfloat16, None: torch.bfloat16}[want.datatype]
    if want.top_k:
        values, indices = torch.topk(x, want.top_k, dim=-1)
        expected = {"LOGITS_TOPK_VALUES": values.to(sent), "LOGITS_TOPK_INDICES": indices.to(torch.int32)}
        if want.topk_tail:
            tail = (1.0 - (values - torch.logsumexp(x, -1, keepdim=True) if not want.logprobs else values)
                    .exp().sum(-1)).clamp_(min=0.0)
            expected["LOGITS_TOPK_TAIL"] = tail.to(torch.float32 if want.datatype is None else sent)
    else:
        expected = {"LOGITS": x.to(sent)}
    for context in (None, OutputContext(chunk_bytes=2 * VOCAB * 4)):
        got = dict(transform_output(logits, spec, want, context))
        assert got.keys() == expected.keys()
        for name, t in expected.items():
            assert got[name].dtype == t.dtype, name
            assert torch.equal(got[name], t), name
    assert torch.equal(logits, before)


def test_log_probs_are_fp32_even_where_no_floating_transform_asked_for_it() -> None:
    """A registered transform that is not marked floating may still ask `Rows.logprobs()` of a
    bf16 chunk: the answer is the fp32 log-softmax, as for the floating transforms."""
    raw = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    rows = Rows(raw, OutputTransform("LOGITS"), "BF16", None, fp32=False)
    assert rows.values is raw  # nothing read it in fp32, so nothing was upcast
    lp = rows.logprobs()
    assert lp.dtype == torch.float32 and torch.equal(lp, torch.log_softmax(raw.float(), dim=-1))


def test_explicit_defaults_and_unsupported_scoring(server: ServerThread) -> None:
    """topk_tail=False without top_k is fine (only asking for a tail without a top-k is refused);
    token_logprobs and SCORE_IDS on a model without a padded token input are refused by name."""
    x = _tokens()
    inp = tg.InferInput("TOKENS", list(x.shape), "INT64")
    inp.set_data_from_numpy(x)
    scores = tg.InferInput("SCORE_IDS", [2, 5, 1], "INT32")
    scores.set_data_from_numpy(np.zeros((2, 5, 1), dtype=np.int32))
    with tg.InferenceServerClient(server.url) as c:
        raw = c.infer("lm", [inp], parameters={"topk_tail": False, "top_k": 0, "logprobs": False})
        assert raw.as_numpy("LOGITS").shape == (2, 5, VOCAB)
        with pytest.raises(InferenceServerException, match="token_logprobs needs a floating per-position output"):
            c.infer("lm", [inp], parameters={"token_logprobs": True})
        with pytest.raises(InferenceServerException, match="SCORE_IDS: none of the wanted outputs"):
            c.infer("lm", [inp, scores])


# ---- a new transform is one entry ---------------------------------------------------------------
def _apply_entropy(rows: Rows) -> None:
    lp = rows.logprobs()
    rows.emit(ENTROPY_OUTPUT, -(lp.exp() * lp).sum(dim=-1))


ENTROPY_OUTPUT = flag_output("entropy", DROP_CLASSES, PROBS)
ENTROPY = flag_transform("entropy", "send <OUT>_ENTROPY, the entropy after temperature per position", _apply_entropy,
                         outputs=(ENTROPY_OUTPUT,), reduces=True, server_default=False)


def test_a_registered_transform_is_parsed_applied_and_its_near_misses_refused() -> None:
    """One `Transform` entry: its parameter is checked (gRPC), applied on the device with the
    temperature before it, its output named after the model's, and `entrpy` refused as a typo."""
    register(ENTROPY)
    try:
        with pytest.raises(ValueError, match="registered already"):
            register(ENTROPY)
        cfg = ServerConfig(model="tests.models:tiny_lm", name="lm", device="cpu", model_args=ARGS)
        x = _tokens()
        inp = tg.InferInput("TOKENS", list(x.shape), "INT64")
        inp.set_data_from_numpy(x)
        with ServerThread(cfg) as s, tg.InferenceServerClient(s.url) as c:
            result = c.infer("lm", [inp], parameters={"entropy": True, "temperature": 2.0, "top_k": 2})
            with pytest.raises(InferenceServerException, match="did you mean 'entropy'"):
                c.infer("lm", [inp], parameters={"entrpy": True})
            with pytest.raises(InferenceServerException, match="entropy must be a boolean"):
                c.infer("lm", [inp], parameters={"entropy": 1})
            plain = c.infer("lm", [inp])
        assert ENTROPY_OUTPUT in DERIVED  # registering declared its output for the student side too
    finally:
        unregister("entropy")
    assert near_miss("entrpy") is None and ENTROPY_OUTPUT not in DERIVED
    with torch.inference_mode():
        lp = torch.log_softmax(tiny_lm(**ARGS).eval()(torch.from_numpy(x)) / 2.0, dim=-1)
    assert [o.name for o in result.get_response().outputs] == ["LOGITS_TOPK_VALUES", "LOGITS_TOPK_INDICES",
                                                                 "LOGITS_ENTROPY"]
    assert np.allclose(result.as_numpy("LOGITS_ENTROPY"), -(lp.exp() * lp).sum(-1).numpy(), atol=1e-5)
    assert [o.name for o in plain.get_response().outputs] == ["LOGITS"]
