"""gRPC TLS and mutual TLS between students and teachers, with certificates made for the test."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import tritonclient.grpc as tg
from tritonclient.utils import InferenceServerException

from distill import DistillReader, NoTeacherError
from teacher_server import ServerConfig, SpecError
from tests.certs import Certs, make_certs
from tests.models import Affine
from tests.servers import ServerThread

AFFINE = Affine()


@pytest.fixture(scope="module")
def certs(tmp_path_factory: pytest.TempPathFactory) -> Certs:
    return make_certs(tmp_path_factory.mktemp("tls"))


def _config(certs: Certs, mutual: bool) -> ServerConfig:
    return ServerConfig(model="tests.models:affine", name="affine", device="cpu", tls_cert=str(certs.server_pem),
                        tls_key=str(certs.server_key), tls_client_ca=str(certs.ca_pem) if mutual else None)


@pytest.fixture(scope="module")
def tls_server(certs: Certs) -> Iterator[ServerThread]:
    with ServerThread(_config(certs, mutual=False)) as s:
        yield s


@pytest.fixture(scope="module")
def mtls_server(certs: Certs) -> Iterator[ServerThread]:
    with ServerThread(_config(certs, mutual=True)) as s:
        yield s


def _x() -> tg.InferInput:
    i = tg.InferInput("X", [2, 8], "FP32")
    i.set_data_from_numpy(np.ones((2, 8), np.float32))
    return i


def _batches() -> list[dict[str, torch.Tensor]]:
    return [{"X": torch.randn(4, 8)} for _ in range(5)]


def test_tls_teacher_with_tritonclient(tls_server: ServerThread, certs: Certs) -> None:
    with tg.InferenceServerClient(tls_server.url, ssl=True, root_certificates=str(certs.ca_pem)) as c:
        assert c.infer("affine", [_x()]).as_numpy("Y").shape == (2, 4)
    with tg.InferenceServerClient(tls_server.url) as plain, pytest.raises(InferenceServerException):
        plain.infer("affine", [_x()], client_timeout=5)
    assert tls_server.server is not None and tls_server.server.record().tls


def test_reader_over_tls(tls_server: ServerThread, certs: Certs) -> None:
    data = _batches()
    with DistillReader(data, teachers=tls_server.url, inputs=["X"], tls_ca=str(certs.ca_pem)) as reader:
        for batch, teacher in reader:
            assert torch.allclose(teacher["Y"], AFFINE(batch["X"]).detach(), atol=1e-5)


def test_mutual_tls_accepts_our_students_and_refuses_others(mtls_server: ServerThread, certs: Certs) -> None:
    data = _batches()
    with DistillReader(data, teachers=mtls_server.url, inputs=["X"], tls_ca=str(certs.ca_pem),
                       tls_cert=str(certs.client_pem), tls_key=str(certs.client_key)) as reader:
        assert sum(1 for _ in reader) == 5
    # No client certificate, or one from another CA: the teacher refuses the handshake.
    for cert, key in ((None, None), (str(certs.rogue_pem), str(certs.rogue_key))):
        reader = DistillReader(data, teachers=mtls_server.url, inputs=["X"], tls_ca=str(certs.ca_pem),
                               tls_cert=cert, tls_key=key, no_teacher_timeout=1.5)
        with pytest.raises(NoTeacherError):
            reader.start()
        reader.close()
    with tg.InferenceServerClient(mtls_server.url, ssl=True, root_certificates=str(certs.ca_pem)) as c, \
            pytest.raises(InferenceServerException):
        c.infer("affine", [_x()], client_timeout=5)


def test_tls_configuration_errors(certs: Certs, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="needs both --tls-cert and --tls-key"):
        ServerConfig(model="m:f", tls_cert=str(certs.server_pem))
    with pytest.raises(SpecError, match="needs --tls-cert and --tls-key too"):
        ServerConfig(model="m:f", tls_client_ca=str(certs.ca_pem))
    with pytest.raises(SpecError, match="does not exist"):
        ServerConfig(model="m:f", tls_cert=str(tmp_path / "nope.pem"), tls_key=str(certs.server_key))
    with pytest.raises(ValueError, match="needs both tls_cert and tls_key"):
        DistillReader([], teachers="127.0.0.1:1", inputs=["X"], tls_cert=str(certs.client_pem))
