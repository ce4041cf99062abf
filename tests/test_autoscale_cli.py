"""`distill-autoscaler` bad input: every mistake exits with status 2 and a message naming it,
before anything is started (no etcd needed: nothing here gets far enough to connect)."""

from __future__ import annotations

import pytest

from distill.autoscale.cli import build_parser, main, policy_from_args

REG = ["--registry", "etcd://127.0.0.1:1", "--service", "svc"]
CMD = ["--", "teacher-server", "--model", "tests.models:affine"]

BAD = [
    ([*REG, "--min", "5", "--max", "3", *CMD], "min_teachers (5) is greater than max_teachers (3)"),
    ([*REG, "--min", "-1", *CMD], "argument --min: '-1' must be >= 0"),
    ([*REG, "--max", "0", *CMD], "argument --max: '0' must be >= 1"),
    ([*REG, "--down-window", "-3", *CMD], "argument --down-window: '-3' must be a finite number >= 0"),
    ([*REG, "--period", "0", *CMD], "argument --period: '0' must be > 0"),
    ([*REG, "--target-utilisation", "0.95", *CMD], "busy_threshold (0.9) is below target_utilisation (0.95)"),
    ([*REG, "--target-utilisation", "1.5", "--busy-threshold", "1", *CMD], "target_utilisation must be in (0, 1]"),
    ([*REG, "--backend", "nomad", *CMD], "unknown backend 'nomad'; choose one of: local, kubernetes"),
    ([*REG], "needs a teacher command after '--'"),
    ([*REG, "--backend", "kubernetes"], "--backend kubernetes needs --deployment NAME"),
    ([*REG, "--backend", "kubernetes", "--deployment", "d", *CMD], "is for --backend local"),
    ([*REG, "--deployment", "d", *CMD], "--deployment is for --backend kubernetes"),
    (["--registry", "static://127.0.0.1:9000", "--service", "svc", *CMD], "--registry must be etcd://"),
    (["--registry", "127.0.0.1:2379", "--service", "svc", *CMD], "invalid registry address"),
    (["--registry", "etcd://127.0.0.1:1", "--service", "a/b", *CMD], "must not contain '/'"),
    ([*REG, "--devices", "gpu0", *CMD], "unknown device 'gpu0'"),
    ([*REG, "--", "teacher-server", "--model", "{model}"], "unknown placeholder {model}"),
    ([*REG, "--gpu-budget", "1", "--gpus-per-teacher", "2", *CMD], "fewer than min_teachers"),
    ([*REG, "--registry-cert", "c.pem", *CMD], "needs both the certificate and its key"),
    ([*REG, "--registry-user", "root", *CMD], "DISTILL_REGISTRY_PASSWORD is not set"),
    ([*REG, "--registry-ca-cert", "/nonexistent/ca.pem", *CMD], "CA certificate /nonexistent/ca.pem does not exist"),
]


@pytest.mark.parametrize(("argv", "message"), BAD, ids=[m[:40] for _, m in BAD])
def test_bad_input_exits_2_with_a_message(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("DISTILL_REGISTRY_PASSWORD", raising=False)
    with pytest.raises(SystemExit) as exc:
        main(argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert message in err, err
    assert err.startswith("usage: distill-autoscaler")


def test_flags_reach_the_policy() -> None:
    args = build_parser().parse_args(
        [
            *REG,
            "--min",
            "0",
            "--max",
            "6",
            "--target-utilization",
            "0.7",
            "--headroom",
            "0.1",
            "--up-window",
            "0",
            "--down-window",
            "120",
            "--max-step",
            "3",
            "--gpu-budget",
            "4",
            "--gpus-per-teacher",
            "2",
        ]
    )
    p = policy_from_args(args)
    assert (p.min_teachers, p.max_teachers, p.target_utilisation, p.headroom) == (0, 6, 0.7, 0.1)
    assert (p.up_window, p.down_window, p.max_step, p.upper) == (0, 120, 3, 2)
