"""The --distill_* flags and the reader options built from them."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

import pytest

from distill import ReaderOptions, add_distill_args, distill_options_from_args
from distill.flags import HeaderArg, header_env_var, headers_map

KEYS = {
    "teachers",
    "transport",
    "registry",
    "service",
    "model",
    "fingerprint",
    "on_fingerprint_change",
    "parameters",
    "top_k",
    "output_dtype",
    "logprobs",
    "temperature",
    "topk_tail",
    "token_logprobs",
    "token_ranks",
    "headers",
    "timeout",
    "fallback",
    "nonfinite",
    "no_teacher_timeout",
    "max_teachers",
    "prefetch",
    "read_ahead_mb",
    "teacher_batch_size",
    "hedge_after",
    "tls_ca",
    "tls_cert",
    "tls_key",
    "registry_options",
    "route_by",
    "default_teacher",
}


def parse(argv: list[str]) -> argparse.Namespace:
    return add_distill_args(argparse.ArgumentParser(prog="train")).parse_args(argv)


def options(argv: list[str]) -> dict[str, object]:
    return distill_options_from_args(parse(argv))


def parse_error(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    with pytest.raises(SystemExit) as exc:
        parse(argv)
    assert exc.value.code == 2
    return capsys.readouterr().err


def test_static_teachers_with_defaults() -> None:
    opts = options(["--distill_teachers", "127.0.0.1:9898,127.0.0.1:9899"])
    assert opts == {
        "teachers": "127.0.0.1:9898,127.0.0.1:9899",
        "registry": None,
        "service": None,
        "model": None,
        "fingerprint": None,
        "on_fingerprint_change": "fail",
        "timeout": 10.0,
        "fallback": "error",
        "nonfinite": "error",
        "no_teacher_timeout": 60.0,
        "max_teachers": 0,
        "prefetch": None,
        "read_ahead_mb": 1024.0,
        "teacher_batch_size": 0,
        "hedge_after": "auto",
        "top_k": 0,
        "output_dtype": None,
        "logprobs": None,
        "temperature": None,
        "topk_tail": None,
        "token_logprobs": None,
        "token_ranks": None,
        "headers": {},
        "transport": "call",
        "parameters": {},
        "tls_ca": None,
        "tls_cert": None,
        "tls_key": None,
        "registry_options": {},
        "route_by": None,
        "default_teacher": None,
    }


def test_registry_with_service_and_every_flag() -> None:
    opts = options(
        [
            "--distill_registry", "etcd://10.0.0.5:2379,10.0.0.6:2379",
            "--distill_service", "cifar-teacher",
            "--distill_timeout", "2.5",
            "--distill_fallback", "hard_labels",
            "--distill_nonfinite", "mask",
            "--distill_no_teacher_timeout", "30",
            "--distill_max_teachers", "3",
            "--distill_prefetch", "8",
            "--distill_read_ahead_mb", "256",
            "--distill_teacher_batch_size", "128",
            "--distill_hedge_ms", "250",
            "--distill_model", "resnet50_trt",
            "--distill_fingerprint", "fp-0123456789abcdef",
            "--distill_on_fingerprint_change", "switch",
            "--distill_top_k", "20",
            "--distill_output_dtype", "bf16",
            "--distill_logprobs",
            "--distill_temperature", "2",
            "--no-distill_topk_tail",
            "--distill_header", "Triton-GRPC-Protocol-Triton-Access-Token=s3cret-token",
            "--distill_transport", "stream",
            "--distill_route_by", "teacher",
            "--distill_default_teacher", "math",
        ]
    )  # fmt: skip
    assert set(opts) == KEYS
    assert opts["teachers"] is None
    assert opts["registry"] == "etcd://10.0.0.5:2379,10.0.0.6:2379"
    assert opts["service"] == "cifar-teacher"
    assert opts["timeout"] == 2.5
    assert opts["fallback"] == "hard_labels"
    assert opts["nonfinite"] == "mask"
    assert opts["no_teacher_timeout"] == 30.0
    assert opts["max_teachers"] == 3
    assert opts["prefetch"] == 8
    assert opts["read_ahead_mb"] == 256.0
    assert opts["teacher_batch_size"] == 128
    assert opts["hedge_after"] == pytest.approx(0.25)
    assert opts["model"] == "resnet50_trt"
    assert opts["fingerprint"] == "fp-0123456789abcdef" and opts["on_fingerprint_change"] == "switch"
    assert opts["top_k"] == 20
    assert opts["output_dtype"] == "BF16"
    assert opts["logprobs"] is True and opts["temperature"] == 2.0 and opts["topk_tail"] is False
    assert opts["headers"] == {"triton-grpc-protocol-triton-access-token": "s3cret-token"}  # name lower-cased
    assert opts["route_by"] == "teacher" and opts["default_teacher"] == "math"
    assert opts["transport"] == "stream"


def test_addresses_are_normalised() -> None:
    assert options(["--distill_teachers", " a:1 , b:0002"])["teachers"] == "a:1,b:2"
    assert options(["--distill_teachers", "a:1,b:2,a:1"])["teachers"] == "a:1,b:2"  # duplicates dropped
    assert options(["--distill_teachers", "static://h:9898"])["teachers"] == "h:9898"
    assert options(["--distill_teachers", "[::1]:9898,[fe80::1]:1"])["teachers"] == "[::1]:9898,[fe80::1]:1"
    reg = options(["--distill_registry", "etcd://h1:2379, h2", "--distill_service", "s"])["registry"]
    assert reg == "etcd://h1:2379,h2:2379"  # etcd's default port when left out


def test_group_is_named_distillation_and_parser_is_returned() -> None:
    parser = argparse.ArgumentParser()
    assert add_distill_args(parser) is parser
    group = next(g for g in parser._action_groups if g.title == "distillation")
    flags = {opt for action in group._group_actions for opt in action.option_strings}
    assert flags == {
        "--distill_teachers",
        "--distill_registry",
        "--distill_service",
        "--distill_timeout",
        "--distill_fallback",
        "--distill_nonfinite",
        "--distill_parameter",
        "--distill_no_teacher_timeout",
        "--distill_max_teachers",
        "--distill_prefetch",
        "--distill_read_ahead_mb",
        "--distill_teacher_batch_size",
        "--distill_hedge_ms",
        "--distill_transport",
        "--distill_model",
        "--distill_fingerprint",
        "--distill_on_fingerprint_change",
        "--distill_route_by",
        "--distill_default_teacher",
        "--distill_top_k",
        "--distill_output_dtype",
        "--distill_logprobs",
        "--no-distill_logprobs",
        "--distill_temperature",
        "--distill_topk_tail",
        "--no-distill_topk_tail",
        "--distill_token_logprobs",
        "--no-distill_token_logprobs",
        "--distill_token_ranks",
        "--no-distill_token_ranks",
        "--distill_header",
        "--distill_tls_ca",
        "--distill_tls_cert",
        "--distill_tls_key",
        "--distill_registry_ca_cert",
        "--distill_registry_cert",
        "--distill_registry_key",
        "--distill_registry_user",
        "--distill_cache",
        "--distill_cache_mode",
    }


def test_registry_security_options_pass_through(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    ca, cert, key = (tmp_path / n for n in ("ca.pem", "client.pem", "client.key"))
    for f in (ca, cert, key):
        f.write_text("x")
    monkeypatch.setenv("DISTILL_REGISTRY_PASSWORD", "s3cret")
    opts = options(["--distill_registry", "etcd://h:2379", "--distill_service", "s",
                    "--distill_registry_ca_cert", str(ca), "--distill_registry_cert", str(cert),
                    "--distill_registry_key", str(key), "--distill_registry_user", "student"])
    assert opts["registry_options"] == {"ca_cert": str(ca), "cert_cert": str(cert), "cert_key": str(key),
                                        "username": "student", "password": "s3cret"}
    monkeypatch.delenv("DISTILL_REGISTRY_PASSWORD")
    with pytest.raises(ValueError, match="DISTILL_REGISTRY_PASSWORD is not set"):
        options(["--distill_registry", "etcd://h:2379", "--distill_service", "s", "--distill_registry_user", "u"])
    with pytest.raises(ValueError, match="needs both the certificate and its key"):
        options(["--distill_registry", "etcd://h:2379", "--distill_service", "s",
                 "--distill_registry_cert", str(cert)])


def test_help_lists_the_group(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse(["--help"])
    out = " ".join(capsys.readouterr().out.split())  # undo argparse's line wrapping
    assert "distillation:" in out
    assert "--distill_registry" in out and "(default: 10.0)" in out


# ---------------------------------------------------------------- cross-field checks (ValueError)


def test_neither_source_says_which_flag_to_pass() -> None:
    with pytest.raises(ValueError, match=r"--distill_teachers host:port.*--distill_registry etcd://"):
        options([])


def test_both_sources_rejected() -> None:
    with pytest.raises(ValueError, match=r"only one of --distill_teachers .* and --distill_registry"):
        options(["--distill_teachers", "a:1", "--distill_registry", "etcd://e:2379", "--distill_service", "s"])


def test_registry_requires_service() -> None:
    with pytest.raises(ValueError, match="--distill_registry needs --distill_service"):
        options(["--distill_registry", "etcd://e:2379"])


def test_service_without_registry_rejected() -> None:
    with pytest.raises(ValueError, match="--distill_service applies only with --distill_registry"):
        options(["--distill_teachers", "a:1", "--distill_service", "s"])


def test_hedge_not_shorter_than_timeout_rejected() -> None:
    with pytest.raises(ValueError, match="--distill_hedge_ms 10000 is not shorter than --distill_timeout 10"):
        options(["--distill_teachers", "a:1", "--distill_hedge_ms", "10000"])
    assert options(["--distill_teachers", "a:1", "--distill_hedge_ms", "9999"])["hedge_after"] == 9.999
    assert options(["--distill_teachers", "a:1", "--distill_hedge_ms", "0"])["hedge_after"] is None  # off


def test_hand_built_namespace_is_validated_too() -> None:
    args = parse(["--distill_teachers", "a:1"])
    args.distill_prefetch = 0
    with pytest.raises(ValueError, match="--distill_prefetch: must be an integer >= 1"):
        distill_options_from_args(args)
    args = parse(["--distill_teachers", "a:1"])
    args.distill_teachers = "nonsense"
    with pytest.raises(ValueError, match="--distill_teachers: bad teacher list 'nonsense'"):
        distill_options_from_args(args)
    args = parse(["--distill_teachers", "a:1"])
    args.distill_fallback = "retry"
    with pytest.raises(ValueError, match="--distill_fallback: must be one of error, hard_labels"):
        distill_options_from_args(args)
    args = parse(["--distill_teachers", "a:1"])
    args.distill_transport = "pigeon"
    with pytest.raises(ValueError, match="--distill_transport: must be one of call, stream, got 'pigeon'"):
        distill_options_from_args(args)


def test_namespace_without_the_flags() -> None:
    with pytest.raises(ValueError, match="add_distill_args"):
        distill_options_from_args(argparse.Namespace(lr=0.1))


# ---------------------------------------------------------------- per-flag checks (argparse errors)


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("host", "'host' has no port"),
        (":9898", "':9898' has no host"),
        ("h:port", "port 'port' is not a number"),
        ("h:0", "1..65535"),
        ("h:65536", "1..65535"),
        ("::1:9898", "without brackets"),
        ("a:1,,b:2", "empty endpoint"),
        ("bad host:1", "not a valid host name"),
        ("etcd://e:2379", "for a registry use --distill_registry"),
        ("static://", "no endpoints"),
    ],
)
def test_bad_teachers(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["--distill_teachers", value], capsys)
    assert "--distill_teachers" in err and message in err


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("e:2379", "expected etcd://HOST:PORT"),
        ("static://a:1", "use --distill_teachers"),
        ("http://e:2379", "unknown scheme 'http://'"),
        ("etcd://", "no endpoints"),
        ("etcd://e:x", "port 'x' is not a number"),
    ],
)
def test_bad_registry(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["--distill_registry", value], capsys)
    assert "--distill_registry" in err and message in err


@pytest.mark.parametrize(
    ("value", "message"),
    [("", "must not be empty"), ("a/b", "must not contain '/'"), ("x\ty", "control characters")],
)
def test_bad_service(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error([f"--distill_service={value}"], capsys)
    assert "--distill_service" in err and message in err


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--distill_timeout", "0", "must be > 0"),
        ("--distill_timeout", "-1", "must be > 0"),
        ("--distill_timeout", "nan", "finite"),
        ("--distill_timeout", "soon", "expected a number"),
        ("--distill_no_teacher_timeout", "0", "must be > 0"),
        ("--distill_max_teachers", "-1", "must be an integer >= 0"),
        ("--distill_max_teachers", "2.5", "expected an integer"),
        ("--distill_prefetch", "0", "must be an integer >= 1"),
        ("--distill_read_ahead_mb", "0", "must be > 0"),
        ("--distill_teacher_batch_size", "-8", "must be an integer >= 0"),
        ("--distill_hedge_ms", "-5", "must be >= 0"),
        ("--distill_hedge_ms", "inf", "finite"),
        ("--distill_fallback", "retry", "invalid choice"),
        ("--distill_transport", "pigeon", "invalid choice"),
        ("--distill_top_k", "-1", "must be an integer >= 0"),
        ("--distill_top_k", "many", "expected an integer"),
        ("--distill_output_dtype", "FP8", "must be one of FP32, FP16, BF16"),
        ("--distill_temperature", "0", "must be > 0"),
        ("--distill_temperature", "inf", "finite"),
        ("--distill_temperature", "warm", "expected a number"),
        ("--distill_model", "", "must be a model name"),
        ("--distill_model", " m", "surrounding spaces"),
    ],
)
def test_bad_numbers_and_choices(flag: str, value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error([f"{flag}={value}"], capsys)
    assert flag in err and message in err


# ---------------------------------------------------------------- model, top-k, dtype, headers


def test_new_options_reach_the_reader_options(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISTILL_HEADER_X_TEAM_TOKEN", "from-the-env")
    args = parse(["--distill_teachers", "a:1", "--distill_model", "linear", "--distill_top_k", "4",
                  "--distill_output_dtype", "fp16", "--distill_header", "x-api-key=k1",
                  "--distill_header", "X-Team.Token"])
    opts = ReaderOptions.from_args(args, inputs=["INPUT"])
    assert opts.model == "linear"
    assert opts.top_k == 4
    assert opts.output_dtype == "FP16"
    assert dict(opts.headers) == {"x-api-key": "k1", "x-team.token": "from-the-env"}
    # Tokens stay out of what scripts print: the parsed flags and the options.
    for shown in (repr(args), str(args), repr(opts)):
        assert "k1" not in shown and "from-the-env" not in shown
    assert "HeaderArg('x-api-key', <hidden>)" in repr(args)
    assert "<from $DISTILL_HEADER_X_TEAM_TOKEN>" in repr(args)


def test_header_from_an_unset_environment_variable() -> None:
    assert header_env_var("triton-grpc-protocol-triton-access-token") == \
        "DISTILL_HEADER_TRITON_GRPC_PROTOCOL_TRITON_ACCESS_TOKEN"
    args = parse(["--distill_teachers", "a:1", "--distill_header", "x-never-set-in-tests"])
    with pytest.raises(ValueError, match=r"\$DISTILL_HEADER_X_NEVER_SET_IN_TESTS, which is not set"):
        distill_options_from_args(args)


def test_header_given_twice_rejected() -> None:
    with pytest.raises(ValueError, match="--distill_header x-key is given twice"):
        options(["--distill_teachers", "a:1", "--distill_header", "x-key=1", "--distill_header", "X-Key=2"])


def test_hand_built_namespace_headers_and_defaults() -> None:
    args = parse(["--distill_teachers", "a:1"])
    args.distill_header = ["X-Key=v"]  # strings, as a script may set them
    assert distill_options_from_args(args)["headers"] == {"x-key": "v"}
    args.distill_header = ["bad key=v"]
    with pytest.raises(ValueError, match="--distill_header: header name 'bad key' is not a valid"):
        distill_options_from_args(args)
    # A namespace from an older flag set, without the newer flags, gets their defaults.
    older = argparse.Namespace(**{k: v for k, v in vars(parse(["--distill_teachers", "a:1"])).items()
                                  if k not in ("distill_model", "distill_top_k", "distill_output_dtype",
                                               "distill_header")})
    opts = distill_options_from_args(older)
    assert (opts["model"], opts["top_k"], opts["output_dtype"], opts["headers"]) == (None, 0, None, {})


@pytest.mark.parametrize(
    ("value", "message"),
    [
        ("grpc-timeout=1", "is reserved"),
        ("content-type=x", "is reserved"),
        ("x-token-bin=abc", "'-bin'"),
        ("bad key=tok3n", "not a valid gRPC metadata key"),
        ("=tok3n", "non-empty string"),
        ("x-key=", "the value is empty"),
        ("x-key=tok3n\u00e9", "printable ASCII"),
        ("x-key=tok3n\nX", "printable ASCII"),
    ],
)
def test_bad_headers(value: str, message: str, capsys: pytest.CaptureFixture[str]) -> None:
    err = parse_error(["--distill_header", value], capsys)
    assert "--distill_header" in err and message in err
    assert "tok3n" not in err.replace("bad key", "")  # the value is never shown


def test_reader_options_check_and_lower_case_headers() -> None:
    opts = ReaderOptions(inputs=["X"], teachers="a:1", headers={"Authorization": "Bearer abc"})
    assert dict(opts.headers) == {"authorization": "Bearer abc"}
    assert "abc" not in repr(opts)
    assert ReaderOptions(inputs=["X"], teachers="a:1").headers == {}
    with pytest.raises(ValueError, match="headers: header name 'x y' is not a valid gRPC metadata key"):
        ReaderOptions(inputs=["X"], teachers="a:1", headers={"x y": "v"})
    with pytest.raises(ValueError, match="headers: header 'a' is given twice"):
        ReaderOptions(inputs=["X"], teachers="a:1", headers={"a": "1", "A": "2"})
    with pytest.raises(ValueError, match="headers: header 'k': the value must be a string, got a bytes"):
        ReaderOptions(inputs=["X"], teachers="a:1", headers={"k": b"v"})
    pairs: Any = [("k", "v")]
    with pytest.raises(ValueError, match="headers: expected a mapping"):
        ReaderOptions(inputs=["X"], teachers="a:1", headers=pairs)
    assert headers_map(None) == {}
    assert repr(HeaderArg.parse("K=v")) == "HeaderArg('k', <hidden>)"


def test_value_transforms_reach_the_reader_options() -> None:
    args = parse(["--distill_teachers", "a:1", "--distill_top_k", "8", "--distill_logprobs",
                  "--distill_temperature", "2.5", "--distill_topk_tail"])
    opts = ReaderOptions.from_args(args, inputs=["INPUT"])
    assert (opts.logprobs, opts.temperature, opts.topk_tail) == (True, 2.5, True)
    off = ReaderOptions.from_args(parse(["--distill_teachers", "a:1", "--no-distill_logprobs",
                                         "--no-distill_topk_tail"]), inputs=["INPUT"])
    assert (off.logprobs, off.temperature, off.topk_tail) == (False, None, False)
    unset = ReaderOptions.from_args(parse(["--distill_teachers", "a:1"]), inputs=["INPUT"])
    assert (unset.logprobs, unset.temperature, unset.topk_tail) == (None, None, None)  # the server's defaults


def test_token_logprobs_is_a_flag_a_request_parameter_and_part_of_the_store_namespace() -> None:
    on = ReaderOptions.from_args(parse(["--distill_teachers", "a:1", "--distill_token_logprobs"]), inputs=["INPUT"])
    assert on.token_logprobs is True and on.request_parameters["token_logprobs"] is True
    assert ("token_logprobs", "true") in on.store_fields()["extra"]
    off = ReaderOptions.from_args(parse(["--distill_teachers", "a:1", "--no-distill_token_logprobs"]),
                                  inputs=["INPUT"])
    assert off.token_logprobs is False and off.request_parameters["token_logprobs"] is False
    unset = ReaderOptions(inputs=["INPUT"], teachers="a:1")
    assert "token_logprobs" not in unset.request_parameters  # the server's default
    assert not any(k == "token_logprobs" for k, _ in unset.store_fields()["extra"])
    with pytest.raises(ValueError, match="token_logprobs: must be True, False or None"):
        ReaderOptions(inputs=["INPUT"], teachers="a:1", token_logprobs=1)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"logprobs": "yes"}, "logprobs: must be True, False or None"),
        ({"topk_tail": 1}, "topk_tail: must be True, False or None"),
        ({"temperature": 0}, "temperature: must be > 0"),
        ({"temperature": float("nan")}, "temperature: expected a finite number"),
        ({"topk_tail": True}, "ask for top_k=K too"),
    ],
)
def test_reader_options_check_value_transforms(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ReaderOptions(inputs=["INPUT"], teachers="a:1", **kwargs)


def test_hand_built_namespace_value_transforms_are_checked() -> None:
    args = parse(["--distill_teachers", "a:1"])
    args.distill_temperature = -1.0
    with pytest.raises(ValueError, match="--distill_temperature: must be > 0"):
        distill_options_from_args(args)
    args.distill_temperature = None
    args.distill_logprobs = "on"
    with pytest.raises(ValueError, match="--distill_logprobs: must be True, False or None"):
        distill_options_from_args(args)
