"""Tokenizer compatibility of a student and its teacher (S-OPD-4).

On-policy distillation compares ``log π_student(y_t)`` with ``log π_teacher(y_t)`` for the
same token id ``y_t`` after the same prefix. That difference means something only when an
id names the same string for both models: two tokenizers that disagree on any text the
student can produce make every per-token signal noise, even when the arrays have equal
lengths. One English sentence is a weak check (the seed's translator's note), so the
student's and the teacher's encodings are compared on probe texts in English, Russian and
Chinese, on code, on every special token of the student's chat template (``<|im_start|>``,
``<think>``, ...) and on a conversation rendered by that template. The first probe whose ids
differ is named in the error.

The prompt itself is rendered once, by the student's tokenizer, and the teacher scores
those ids (it never re-tokenizes text, and its own chat template is never applied), so a
teacher whose template differs but whose vocabulary agrees is still aligned.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

PROBE_TEXTS: tuple[tuple[str, str], ...] = (
    ("English", "A short tokenizer alignment test: 17 + 18 = 35."),
    ("Russian", "Короткая проверка совместимости токенизаторов: ученик и учитель."),
    ("Chinese", "分词器对齐的简短测试：学生模型和教师模型。"),
    ("code", 'def add(a: int, b: int) -> int:\n    """Sum."""\n    return a + b  # {x: [1, 2]}\n'),
)
PROBE_CONVERSATION = (
    {"role": "user", "content": "What is 2 + 2?"},
    {"role": "assistant", "content": "<think>\n2 + 2 = 4\n</think>\n\nThe answer is 4."},
)


def probe_texts(student_tokenizer) -> list[tuple[str, str]]:
    """(name, text) pairs to encode with both tokenizers, in the order they are checked.

    The fixed texts come first, then each added token of the student that its chat template
    uses (``special token '<|im_start|>'``), then a conversation rendered by that template.
    """
    probes = list(PROBE_TEXTS)
    template = getattr(student_tokenizer, "chat_template", None) or ""
    added = getattr(student_tokenizer, "added_tokens_decoder", {}) or {}
    specials = [token.content for _, token in sorted(added.items())]
    for content in specials:
        if content in template or content in ("<think>", "</think>"):
            probes.append((f"special token {content!r}", content))
    if template:
        rendered = student_tokenizer.apply_chat_template(list(PROBE_CONVERSATION), tokenize=False)
        probes.append(("chat template rendering", rendered))
    return probes


def _preview(ids: Sequence[int], limit: int = 12) -> str:
    shown = ", ".join(str(i) for i in ids[:limit])
    return f"[{shown}{', ...' if len(ids) > limit else ''}] ({len(ids)} ids)"


def check_tokenizers(
    student_tokenizer,
    teacher_encode: Callable[[str], list[int]],
    teacher_name: str,
) -> int:
    """Raise DnaConfigError naming the first probe the two tokenizers encode differently.

    Args:
        student_tokenizer: the student's 🤗 tokenizer (its chat template supplies the special-token probes).
        teacher_encode: text -> teacher token ids without added special tokens (a local tokenizer's
            ``encode`` or a teacher server's ``/tokenize``).
        teacher_name: how the error refers to the teacher (a path or a server URL).

    Returns:
        The number of probes that matched.
    """
    probes = probe_texts(student_tokenizer)
    for name, text in probes:
        student_ids = list(student_tokenizer.encode(text, add_special_tokens=False))
        teacher_ids = list(teacher_encode(text))
        if student_ids != teacher_ids:
            at = next(
                (i for i, (s, t) in enumerate(zip(student_ids, teacher_ids, strict=False)) if s != t),
                min(len(student_ids), len(teacher_ids)),
            )
            raise DnaConfigError(
                f"The student's and the teacher's tokenizers disagree on the {name} probe {text[:60]!r}: "
                f"first difference at id {at}, student {_preview(student_ids)} vs teacher {_preview(teacher_ids)} "
                f"(teacher {teacher_name}). On-policy distillation compares log-probabilities of the same token "
                "ids, so both models must share one tokenizer. Use a teacher from the student's model family "
                "(same vocabulary and special tokens)."
            )
    logger.info(
        "Tokenizers agree on %d probes (English, Russian, Chinese, code, template specials).", len(probes)
    )
    return len(probes)


def compare_vocabularies(student_tokenizer, teacher_tokenizer, teacher_name: str) -> int:
    """Raise DnaConfigError unless both tokenizers map exactly the same strings to the same ids (added tokens too).

    Complete where the probes are a sample: two local tokenizers can agree on every probe text and
    still give a rare token another id. A dictionary comparison of a 150k vocabulary takes milliseconds.

    Returns:
        The vocabulary size.
    """
    student, teacher = student_tokenizer.get_vocab(), teacher_tokenizer.get_vocab()
    if student == teacher:
        return len(student)
    moved = sorted((k for k in student.keys() & teacher.keys() if student[k] != teacher[k]), key=student.get)
    only_student = sorted(student.keys() - teacher.keys(), key=student.get)
    only_teacher = sorted(teacher.keys() - student.keys(), key=teacher.get)
    examples = [f"{k!r}: student {student[k]}, teacher {teacher[k]}" for k in moved[:3]]
    examples += [f"{k!r} only in the student ({student[k]})" for k in only_student[:2]]
    examples += [f"{k!r} only in the teacher ({teacher[k]})" for k in only_teacher[:2]]
    raise DnaConfigError(
        f"The student's and the teacher's vocabularies differ: {len(moved)} tokens have other ids, "
        f"{len(only_student)} are only in the student and {len(only_teacher)} only in the teacher "
        f"(teacher {teacher_name}; e.g. {'; '.join(examples)}). On-policy distillation compares log-probabilities "
        "of the same token ids, so both models must share one tokenizer. Use a teacher from the student's model "
        "family (same vocabulary and special tokens)."
    )


def load_local_tokenizer(path: str, revision: str | None = None, trust_remote_code: bool = False):
    """The teacher's tokenizer from ``path`` (a directory or a hub id)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, revision=revision, trust_remote_code=trust_remote_code)
