"""TRL's `ServerDistillationTrainer` (trl.experimental.server_distillation), unchanged, trains a tiny
student for a few steps on CPU with its teacher reached only through `distill gateway`: the gateway
runs as its own process in front of a real `teacher-server --model hf:DIR` process, and the trainer
is given nothing but the gateway's URL as `teacher_model_server_url`.

What runs is TRL's whole training loop: the student's on-policy completions from
`transformers.generate` (`use_vllm=False`, TRL's default, which needs neither vLLM nor a GPU), the
teacher's top-k and actual-token log-probs from `VLLMClient.get_sequence_logprobs` through the
gateway, TRL's sparse top-k forward-KL loss with its tail bucket, backward and the optimizer step.
One check is satisfied, not run: `VLLMClient.__init__` refuses to start unless the `vllm` package is
importable, although the scoring path it runs never uses vLLM; `is_vllm_available` in the client's
module answers True (as in tests/test_trl_client.py), and nothing else of TRL is patched.
"""

from __future__ import annotations

import math
import re
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.hf_models import save_llama
from tests.servers import teacher_process
from tests.test_gateway import START_S, gateway_process, wait_for_status

transformers = pytest.importorskip("transformers")
datasets = pytest.importorskip("datasets")
pytest.importorskip("trl")
vllm_client = pytest.importorskip("trl.generation.vllm_client")

STEPS, BATCH = 3, 2
PROMPTS = ["w3 w4 w5", "w10 w11", "w20 w21 w22 w23", "w30", "w40 w41", "w50 w51 w52"]


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("tiny-llama-trainer")
    save_llama(directory, tokenizer=True)
    return directory


@pytest.fixture(scope="module")
def teacher(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    args = ["--model", f"hf:{llama_dir}", "--name", "tiny-llama", "--device", "cpu", "--http-port", "0",
            "--metrics-port", "0"]
    with teacher_process(args, tmp_path_factory.mktemp("trainer-teacher")) as (_, info):
        yield info


def _successes(teacher: dict[str, Any]) -> float:
    """The teacher's own count of inference requests it answered (its Prometheus metrics)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{teacher['metrics_port']}/metrics", timeout=10) as r:
        text = r.read().decode()
    found = re.search(r"^nv_inference_request_success\{[^}]*\} (\S+)$", text, re.M)
    return float(found.group(1)) if found else 0.0


def _student(llama_dir: Path) -> Any:
    """The teacher's architecture and vocabulary with other random weights, so the loss has work to do."""
    config = transformers.AutoConfig.from_pretrained(str(llama_dir), local_files_only=True)
    torch.manual_seed(1)
    return transformers.LlamaForCausalLM(config)


def test_server_distillation_trainer_trains_through_the_gateway(
        teacher: dict[str, Any], llama_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRL_EXPERIMENTAL_SILENCE", "1")
    monkeypatch.setattr(vllm_client, "is_vllm_available", lambda *a, **k: True)
    from trl.experimental.server_distillation import ServerDistillationConfig, ServerDistillationTrainer

    tokenizer = transformers.AutoTokenizer.from_pretrained(str(llama_dir), local_files_only=True)
    tokenizer.eos_token = "w59"  # the word-level tokenizer has none; generation stops on it
    student = _student(llama_dir)
    before = {name: p.detach().clone() for name, p in student.named_parameters()}

    with gateway_process(["--teachers", f"127.0.0.1:{teacher['port']}", "--model", "tiny-llama"]) as (_, base):
        wait_for_status(base + "/health", 200, START_S)
        args = ServerDistillationConfig(
            output_dir=str(tmp_path / "out"), teacher_model_server_url=base, max_steps=STEPS,
            per_device_train_batch_size=BATCH, max_completion_length=6, loss_top_k=4, beta=0.0, temperature=1.0,
            learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True, seed=0,
            dataloader_num_workers=0, bf16=False)
        trainer = ServerDistillationTrainer(model=student, args=args, processing_class=tokenizer,
                                            train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}))
        assert trainer.teacher_client.model == "tiny-llama"  # resolved from the gateway's /v1/models
        served_before = _successes(teacher)
        result = trainer.train()

    assert trainer.state.global_step == STEPS
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    assert len(losses) == STEPS and all(math.isfinite(x) for x in losses), trainer.state.log_history
    assert math.isfinite(result.training_loss) and result.training_loss > 0
    # every step scored each of its completions at the teacher behind the gateway (a hedge may add more)
    assert _successes(teacher) - served_before >= STEPS * BATCH
    changed = [name for name, p in student.named_parameters() if not torch.equal(p.detach(), before[name])]
    assert changed, "no student weight changed"
