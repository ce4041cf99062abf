"""gRPC TLS and mutual TLS between students and teachers, with certificates made for the test.

A refusal must be the certificate's, not any error: each one is checked to be a connection-level
``UNAVAILABLE`` (not an answer from the model), and next to a control that differs only in the
certificate and succeeds. The raw TLS probe (:func:`_probe`) shows where it fails: a teacher that
refuses a student's certificate closes the connection before speaking HTTP/2, and a student that
refuses a teacher's certificate fails its own verification.
"""

from __future__ import annotations

import socket
import ssl
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


def _config(certs: Certs, mutual: bool, server: str = "server") -> ServerConfig:
    return ServerConfig(model="tests.models:affine", name="affine", device="cpu",
                        tls_cert=str(certs.dir / f"{server}.pem"), tls_key=str(certs.dir / f"{server}.key"),
                        tls_client_ca=str(certs.ca_pem) if mutual else None)


@pytest.fixture(scope="module")
def tls_server(certs: Certs) -> Iterator[ServerThread]:
    with ServerThread(_config(certs, mutual=False)) as s:
        yield s


@pytest.fixture(scope="module")
def mtls_server(certs: Certs) -> Iterator[ServerThread]:
    with ServerThread(_config(certs, mutual=True)) as s:
        yield s


@pytest.fixture(scope="module")
def rogue_server(certs: Certs) -> Iterator[ServerThread]:
    """A teacher whose certificate comes from another CA than the one students trust."""
    with ServerThread(_config(certs, mutual=False, server="rogue_server")) as s:
        yield s


def _probe(port: int, ca: Path | None, cert: Path | None = None, key: Path | None = None) -> str:
    """Open a raw connection (TLS when ``ca`` is given), send the HTTP/2 preface and say what came back:
    ``"http2"`` (the server's SETTINGS frame: the handshake passed), ``"closed"`` (the server hung up
    before speaking HTTP/2) or ``"verify failed: ..."`` (we refused the server's certificate)."""
    preface = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes.fromhex("000000040000000000")  # + empty SETTINGS
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as raw:
            conn: socket.socket = raw
            if ca is not None:
                ctx = ssl.create_default_context(cafile=str(ca))
                ctx.set_alpn_protocols(["h2"])
                if cert is not None and key is not None:
                    ctx.load_cert_chain(str(cert), str(key))
                conn = ctx.wrap_socket(raw, server_hostname="127.0.0.1")
            conn.settimeout(10)
            conn.sendall(preface)
            head = conn.recv(9)
    except ssl.SSLCertVerificationError as e:
        return f"verify failed: {e.verify_message}"
    except OSError:  # reset, EOF in violation of the protocol, ...
        return "closed"
    return "http2" if len(head) == 9 and head[3] == 0x04 else "closed"  # frame type 4: SETTINGS


def _assert_unavailable(e: InferenceServerException, *fragments: str) -> None:
    """A connection-level failure (no answer from the model at all), with these words in it."""
    assert e.status() == "StatusCode.UNAVAILABLE", (e.status(), e.message())
    message = e.message() or ""
    assert "failed to connect to all addresses" in message, message
    assert "Connection refused" not in message, message  # the teacher is up: it refused us
    for fragment in fragments:
        assert fragment in message, message


def _x() -> tg.InferInput:
    i = tg.InferInput("X", [2, 8], "FP32")
    i.set_data_from_numpy(np.ones((2, 8), np.float32))
    return i


def _batches() -> list[dict[str, torch.Tensor]]:
    return [{"X": torch.randn(4, 8)} for _ in range(5)]


def test_tls_teacher_with_tritonclient(tls_server: ServerThread, certs: Certs) -> None:
    with tg.InferenceServerClient(tls_server.url, ssl=True, root_certificates=str(certs.ca_pem)) as c:
        assert c.infer("affine", [_x()]).as_numpy("Y").shape == (2, 4)
    with tg.InferenceServerClient(tls_server.url) as plain, pytest.raises(InferenceServerException) as refused:
        plain.infer("affine", [_x()], client_timeout=5)
    _assert_unavailable(refused.value)
    # Plaintext HTTP/2 is hung up on; the same preface over TLS gets the server's SETTINGS.
    assert _probe(tls_server.port, None) == "closed"
    assert _probe(tls_server.port, certs.ca_pem) == "http2"
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
    assert _probe(mtls_server.port, certs.ca_pem, certs.client_pem, certs.client_key) == "http2"
    # No client certificate, or one from another CA: the teacher refuses the handshake. The reader
    # never gets the teacher's metadata, and a raw TLS client with the same certificate is hung up
    # on before HTTP/2, where the one above (our CA's certificate) got the server's SETTINGS.
    for cert, key in ((None, None), (certs.rogue_pem, certs.rogue_key)):
        reader = DistillReader(data, teachers=mtls_server.url, inputs=["X"], tls_ca=str(certs.ca_pem),
                               tls_cert=None if cert is None else str(cert), tls_key=None if key is None else str(key),
                               no_teacher_timeout=1.5)
        with pytest.raises(NoTeacherError, match=r"\[waiting for metadata"):
            reader.start()
        reader.close()
        assert _probe(mtls_server.port, certs.ca_pem, cert, key) == "closed", cert
    with tg.InferenceServerClient(mtls_server.url, ssl=True, root_certificates=str(certs.ca_pem)) as c, \
            pytest.raises(InferenceServerException) as refused:
        c.infer("affine", [_x()], client_timeout=5)
    _assert_unavailable(refused.value)


def test_student_refuses_a_teacher_certified_by_another_ca(rogue_server: ServerThread, certs: Certs) -> None:
    data = _batches()
    reader = DistillReader(data, teachers=rogue_server.url, inputs=["X"], tls_ca=str(certs.ca_pem),
                           no_teacher_timeout=1.5)
    with pytest.raises(NoTeacherError, match=r"\[waiting for metadata"):
        reader.start()
    reader.close()
    with tg.InferenceServerClient(rogue_server.url, ssl=True, root_certificates=str(certs.ca_pem)) as c, \
            pytest.raises(InferenceServerException) as refused:
        c.infer("affine", [_x()], client_timeout=5)
    _assert_unavailable(refused.value, "handshake failed", "CERTIFICATE_VERIFY_FAILED")
    assert _probe(rogue_server.port, certs.ca_pem).startswith("verify failed: unable to get local issuer")
    # The control: trusting the other CA, the same student uses the same teacher.
    with DistillReader(data, teachers=rogue_server.url, inputs=["X"], tls_ca=str(certs.rogue_ca_pem)) as ok:
        assert sum(1 for _ in ok) == 5


def test_tls_configuration_errors(certs: Certs, tmp_path: Path) -> None:
    with pytest.raises(SpecError, match="needs both --tls-cert and --tls-key"):
        ServerConfig(model="m:f", tls_cert=str(certs.server_pem))
    with pytest.raises(SpecError, match="needs --tls-cert and --tls-key too"):
        ServerConfig(model="m:f", tls_client_ca=str(certs.ca_pem))
    with pytest.raises(SpecError, match="does not exist"):
        ServerConfig(model="m:f", tls_cert=str(tmp_path / "nope.pem"), tls_key=str(certs.server_key))
    with pytest.raises(ValueError, match="needs both tls_cert and tls_key"):
        DistillReader([], teachers="127.0.0.1:1", inputs=["X"], tls_cert=str(certs.client_pem))
