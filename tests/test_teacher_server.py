"""The teacher server client under faults: every request bounded, retried with back-off, and failing clearly.

Real HTTP against :class:`tests.teacher_fixtures.FaultyTeacher` (aiohttp); no model loads.
"""

from __future__ import annotations

import time

import pytest

from dna_factory.errors import DnaConfigError, DnaServiceError
from tests.lazy import lazy
from tests.teacher_fixtures import FaultyTeacher

distill_stage = lazy("dna_factory.distill.stage")
teacher_api = lazy("dna_factory.distill.teacher_server")


@pytest.fixture(scope="module")
def student_tokenizer(tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model)


FAST = {"request_timeout_s": 0.5, "retries": 2, "backoff_s": 0.0}


def test_a_stalled_teacher_fails_within_the_bound_after_its_retries(student_tokenizer):
    with FaultyTeacher(student_tokenizer, "stall", delay_s=3.0) as server:
        teacher = teacher_api.TeacherServer(server.url, **FAST)
        started = time.perf_counter()
        with pytest.raises(DnaServiceError, match=r"did not answer .*within 0\.5 s.* 3 tries"):
            teacher.score([[1, 2, 3]], [[20, 21]])
        elapsed = time.perf_counter() - started
        assert server.scoring_requests == 3  # the first try and two retries
    assert elapsed < 2.9  # never waited for the stalled answer (3 s)


def test_transient_server_errors_are_retried(student_tokenizer):
    with FaultyTeacher(student_tokenizer, "flaky", failures=2) as server:
        scores = teacher_api.TeacherServer(server.url, **FAST).score([[1, 2, 3]], [[20, 21]])
        assert server.scoring_requests == 3
    assert scores == [[FaultyTeacher.logprob(20), FaultyTeacher.logprob(21)]]


def test_a_failing_server_is_one_clear_error_naming_the_status(student_tokenizer):
    with FaultyTeacher(student_tokenizer, "flaky", failures=100) as server:
        with pytest.raises(DnaServiceError, match=r"HTTP 503 .*after 3 tries.*overloaded"):
            teacher_api.TeacherServer(server.url, **FAST).score([[1, 2, 3]], [[20, 21]])
        assert server.scoring_requests == 3


def test_a_sequence_over_the_teachers_max_model_len_names_both_lengths_before_sending(student_tokenizer):
    with FaultyTeacher(student_tokenizer, max_model_len=8) as server:
        teacher = teacher_api.TeacherServer(server.url, **FAST)
        with pytest.raises(DnaConfigError, match=r"10 tokens \(prompt 6 \+ completion 4\).*max_model_len 8"):
            teacher.score([[1, 2, 3], [1, 2, 3, 4, 5, 6]], [[20], [20, 21, 22, 23]])
        assert server.scoring_requests == 0


def test_the_servers_400_for_an_over_long_sequence_names_both_lengths(student_tokenizer):
    with FaultyTeacher(student_tokenizer, max_model_len=8, advertise_max_model_len=False) as server:
        teacher = teacher_api.TeacherServer(server.url, **FAST)
        with pytest.raises(DnaConfigError, match=r"10 tokens \(prompt 6 \+ completion 4\).*max_model_len 8"):
            teacher.score([[1, 2, 3, 4, 5, 6]], [[20, 21, 22, 23]])
        assert server.scoring_requests == 1  # a 400 is not retried


def test_a_sequence_of_exactly_max_model_len_is_refused_before_sending_and_from_the_400(student_tokenizer):
    """Scoring asks for one generated token: at exactly max_model_len vLLM says max_tokens must be at least 1."""
    for advertise, sent, says in ((True, 0, "max_model_len 8"), (False, 1, "max_tokens must be at least 1")):
        with FaultyTeacher(student_tokenizer, max_model_len=8, advertise_max_model_len=advertise) as server:
            teacher = teacher_api.TeacherServer(server.url, **FAST)
            with pytest.raises(DnaConfigError, match=rf"8 tokens \(prompt 5 \+ completion 3\).*{says}"):
                teacher.score([[1, 2, 3, 4, 5]], [[20, 21, 22]])
            assert server.scoring_requests == sent


def test_an_unauthorised_model_listing_is_one_clear_error(student_tokenizer):
    with (
        FaultyTeacher(student_tokenizer, "unauthorised") as server,
        pytest.raises(DnaServiceError, match=r"answered /v1/models with HTTP 401"),
    ):
        teacher_api.TeacherServer(server.url, **FAST)


def test_a_server_without_tokenize_is_a_config_error(student_tokenizer):
    with (
        FaultyTeacher(student_tokenizer, "no_tokenize") as server,
        pytest.raises(DnaConfigError, match=r"has no /tokenize endpoint \(HTTP 404\)"),
    ):
        teacher_api.TeacherServer(server.url, **FAST).check_alignment(student_tokenizer)


def test_a_server_reporting_logits_is_refused_by_the_probe(student_tokenizer):
    with (
        FaultyTeacher(student_tokenizer, "unnormalised") as server,
        pytest.raises(
            DnaConfigError, match=r"not log-probabilities at position 1 .*--logprobs-mode raw_logprobs"
        ),
    ):
        teacher_api.TeacherServer(server.url, **FAST).check_alignment(student_tokenizer)


def test_the_probe_pins_every_sampling_setting(student_tokenizer):
    with FaultyTeacher(student_tokenizer) as server:
        teacher_api.TeacherServer(server.url, **FAST).check_alignment(student_tokenizer)
    sampled, scored = server.probe_bodies
    assert {k: sampled.get(k) for k in teacher_api.PINNED_SAMPLING} == teacher_api.PINNED_SAMPLING
    # every sampling setting the off-policy check knows is pinned to a neutral value
    assert all(sampled.get(k, "missing") in neutral for k, neutral in distill_stage.NEUTRAL_SAMPLING.items())
    assert scored["prompt_logprobs"] >= 5  # enough alternatives to see a log-sum-exp above 0
