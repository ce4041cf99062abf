"""The LLM teacher's rendered command line, run: a real teacher-server started with the manifest's
own arguments (bf16 included) on a tiny Llama saved with save_pretrained where the weights volume
would be, changed only where a pod and this machine differ (cpu for cuda:0, loopback and free
ports for the pod's addresses, a local etcd for the cluster's), registers under the manifest's
service and answers on gRPC, on the HTTP port the manifest declares, and on its metrics port."""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import transformers
import tritonclient.grpc as tg

from discovery import EtcdRegistry
from discovery.local_etcd import LocalEtcd, free_port
from tests.etcd_fixtures import arun
from tests.servers import teacher_process
from tests.test_deploy_render import container, find, flag, variant

pytestmark = pytest.mark.timeout(120)
VOCAB = 97


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEtcd]:
    with LocalEtcd(tmp_path_factory.mktemp("etcd")) as server:
        yield server


def test_the_rendered_llm_teacher_command_serves_registers_and_exports_metrics(
    etcd: LocalEtcd, tmp_path: Path
) -> None:
    c = container(find(variant("llm"), "Deployment", "llm-teacher"), "teacher")
    (mount,) = c["volumeMounts"]
    volume = tmp_path / "volume"
    model_dir = Path(str(volume) + flag(c, "--model").removeprefix("hf:").removeprefix(mount["mountPath"]))
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      pad_token_id=0)  # fmt: skip
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).eval().save_pretrained(str(model_dir))

    http, metrics = free_port(), free_port()
    here = {  # what differs between a pod and this machine; every other flag is the manifest's
        "--device": "cpu", "--host": "127.0.0.1", "--port": "0", "--http-port": str(http),
        "--metrics-port": str(metrics), "--registry": etcd.address, "--instance-id": "llm-teacher-0",
    }  # fmt: skip
    args = []
    for a in c["args"]:
        name, _, value = a.partition("=")
        if name == "--advertise":
            continue  # $(POD_IP): the default, --host:--port, is the address here
        args.append(f"{name}={here.get(name, value)}".replace(f"hf:{mount['mountPath']}", f"hf:{volume}"))
    assert sum(a.split("=")[0] in here for a in args) == len(here)
    env = {e["name"]: e["value"] for e in c["env"] if "value" in e}
    service = flag(c, "--service")

    with teacher_process(args, tmp_path, env=env, timeout=90) as (_, info):
        ids = np.random.default_rng(0).integers(1, VOCAB, size=(2, 7), dtype=np.int64)
        with tg.InferenceServerClient(f"127.0.0.1:{info['port']}") as client:
            inputs = []
            for name, x in (("INPUT_IDS", ids), ("ATTENTION_MASK", np.ones_like(ids))):
                i = tg.InferInput(name, list(x.shape), "INT64")
                i.set_data_from_numpy(x)
                inputs.append(i)
            logits = client.infer(flag(c, "--name"), inputs).as_numpy("LOGITS")
        assert logits.shape == (2, 7, VOCAB) and np.isfinite(logits).all()
        with urllib.request.urlopen(f"http://127.0.0.1:{http}/v2/health/ready", timeout=10) as r:
            assert r.status == 200
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            assert 'nv_inference_count{model="llm",version="1"} 2.0' in r.read().decode()

        async def registered() -> set[str]:
            async with EtcdRegistry(etcd.endpoint) as reg:
                return set(await reg.teachers(service))

        assert "llm-teacher-0" in arun(registered())
