"""The 25 IFEval instruction checkers, keyed by IFEval's instruction ids.

Each checker is ``checker(response, **kwargs) -> bool`` whose keyword parameters are IFEval's
``kwargs`` names, so a row's ``instruction_id_list`` and ``kwargs`` apply as they are. The rules
follow Google's reference ``instruction_following_eval/instructions.py`` (Apache-2.0), checked
against it case by case; differences are listed in :mod:`rewards.ifeval.text` (sentence
splitting, capital-word tokens) and here:

- keywords are matched literally (the reference feeds them to ``re`` unescaped, which only
  differs for keywords holding regex characters);
- an unknown ``relation`` raises ``ValueError`` instead of being ignored.

``relation`` values are IFEval's ``"less than"`` (count < N) and ``"at least"`` (count >= N).

Example:
    >>> CHECKERS["keywords:letter_frequency"]("banana", letter="a", let_frequency=3, let_relation="at least")
    True
    >>> CHECKERS["punctuation:no_comma"]("no, sorry")
    False
"""

from __future__ import annotations

import json
import re
from collections import Counter
from collections.abc import Callable

from rewards.ifeval.text import capital_words, count_sentences, count_words, detect_language

RELATIONS = ("less than", "at least")
CONSTRAINED_RESPONSES = ("My answer is yes.", "My answer is no.", "My answer is maybe.")
"""The options ``detectable_format:constrained_response`` accepts (one must appear)."""


def _compare(count: int, relation: str, threshold: int) -> bool:
    if relation == "less than":
        return count < threshold
    if relation == "at least":
        return count >= threshold
    raise ValueError(f"Unknown IFEval relation {relation!r}. Use one of: {', '.join(RELATIONS)}.")


# --- keywords ---------------------------------------------------------------------------------


def keywords_existence(response: str, *, keywords: list[str]) -> bool:
    """Every keyword appears (case-insensitive substring)."""
    return all(re.search(re.escape(keyword), response, re.IGNORECASE) for keyword in keywords)


def keywords_frequency(response: str, *, keyword: str, frequency: int, relation: str) -> bool:
    """The keyword's case-insensitive occurrences compare to ``frequency`` by ``relation``."""
    count = len(re.findall(re.escape(keyword.strip()), response, re.IGNORECASE))
    return _compare(count, relation, frequency)


def keywords_forbidden_words(response: str, *, forbidden_words: list[str]) -> bool:
    """No forbidden word appears as a whole word (case-insensitive)."""
    return not any(
        re.search(r"\b" + re.escape(word) + r"\b", response, re.IGNORECASE) for word in set(forbidden_words)
    )


def keywords_letter_frequency(response: str, *, letter: str, let_frequency: int, let_relation: str) -> bool:
    """The letter's case-insensitive count compares to ``let_frequency`` by ``let_relation``."""
    return _compare(Counter(response.lower())[letter.strip().lower()], let_relation, let_frequency)


# --- language and case ------------------------------------------------------------------------


def language_response_language(response: str, *, language: str) -> bool:
    """``langdetect`` finds ``language`` (ISO 639-1); undetectable text passes, as in IFEval."""
    detected = detect_language(response)
    return detected is None or detected == language


def change_case_english_capital(response: str) -> bool:
    """All letters are capitals and the text is English (undetectable language passes)."""
    return response.isupper() and detect_language(response) in (None, "en")


def change_case_english_lowercase(response: str) -> bool:
    """All letters are lowercase and the text is English (undetectable language passes)."""
    return response.islower() and detect_language(response) in (None, "en")


def change_case_capital_word_frequency(
    response: str, *, capital_frequency: int, capital_relation: str
) -> bool:
    """The number of all-capital words compares to ``capital_frequency`` by ``capital_relation``."""
    return _compare(len(capital_words(response)), capital_relation, capital_frequency)


# --- length -----------------------------------------------------------------------------------


def length_number_words(response: str, *, num_words: int, relation: str) -> bool:
    """The number of ``\\w+`` words compares to ``num_words`` by ``relation``."""
    return _compare(count_words(response), relation, num_words)


def length_number_sentences(response: str, *, num_sentences: int, relation: str) -> bool:
    """The number of sentences compares to ``num_sentences`` by ``relation``."""
    return _compare(count_sentences(response), relation, num_sentences)


def length_number_paragraphs(response: str, *, num_paragraphs: int) -> bool:
    """Exactly ``num_paragraphs`` paragraphs separated by ``***``; an empty one between fails."""
    paragraphs = re.split(r"\s?\*\*\*\s?", response)
    count = len(paragraphs)
    for index, paragraph in enumerate(paragraphs):
        if not paragraph.strip():
            if index in (0, len(paragraphs) - 1):
                count -= 1
            else:
                return False
    return count == num_paragraphs


def length_nth_paragraph_first_word(
    response: str, *, num_paragraphs: int, nth_paragraph: int, first_word: str
) -> bool:
    """Exactly ``num_paragraphs`` paragraphs (split on blank lines), the ``nth_paragraph``-th
    (1-based) starting with ``first_word`` (case-insensitive, punctuation after it ignored)."""
    paragraphs = re.split(r"\n\n", response)
    count = sum(1 for paragraph in paragraphs if paragraph.strip())
    if nth_paragraph > count:
        return False
    paragraph = paragraphs[nth_paragraph - 1].strip()
    if not paragraph:
        return False
    word = paragraph.split()[0].strip().lstrip("'").lstrip('"')
    found = ""
    for char in word:
        if char in ".,?!'\"":
            break
        found += char.lower()
    return count == num_paragraphs and found == first_word.lower()


# --- content and format -----------------------------------------------------------------------


def content_number_placeholders(response: str, *, num_placeholders: int) -> bool:
    """At least ``num_placeholders`` square-bracket placeholders such as ``[address]``."""
    return len(re.findall(r"\[.*?\]", response)) >= num_placeholders


def content_postscript(response: str, *, postscript_marker: str) -> bool:
    """A line starts with the postscript marker (``P.S.``, ``P.P.S`` or any other)."""
    marker = postscript_marker.strip()
    if marker == "P.P.S":
        pattern = r"\s*p\.\s?p\.\s?s.*$"
    elif marker == "P.S.":
        pattern = r"\s*p\.\s?s\..*$"
    else:
        pattern = r"\s*" + re.escape(marker.lower()) + r".*$"
    return bool(re.findall(pattern, response.lower(), flags=re.MULTILINE))


def format_number_bullet_lists(response: str, *, num_bullets: int) -> bool:
    """Exactly ``num_bullets`` markdown bullet lines (``* item`` or ``- item``)."""
    stars = re.findall(r"^\s*\*[^\*].*$", response, flags=re.MULTILINE)
    dashes = re.findall(r"^\s*-.*$", response, flags=re.MULTILINE)
    return len(stars) + len(dashes) == num_bullets


def format_constrained_response(response: str) -> bool:
    """One of :data:`CONSTRAINED_RESPONSES` appears."""
    text = response.strip()
    return any(option in text for option in CONSTRAINED_RESPONSES)


def format_number_highlighted_sections(response: str, *, num_highlights: int) -> bool:
    """At least ``num_highlights`` non-empty ``*highlighted*`` (or ``**bold**``) spans."""
    count = sum(1 for span in re.findall(r"\*[^\n\*]*\*", response) if span.strip("*").strip())
    count += sum(
        1
        for span in re.findall(r"\*\*[^\n\*]*\*\*", response)
        if span.removeprefix("**").removesuffix("**").strip()
    )
    return count >= num_highlights


def format_multiple_sections(response: str, *, section_spliter: str, num_sections: int) -> bool:
    """At least ``num_sections`` sections, each opened by ``<section_spliter> <number>``."""
    pattern = r"\s?" + re.escape(section_spliter.strip()) + r"\s?\d+\s?"
    return len(re.split(pattern, response)) - 1 >= num_sections


def format_json_format(response: str) -> bool:
    """The whole response (markdown fences allowed) parses as JSON."""
    text = response.strip()
    for prefix in ("```json", "```Json", "```JSON", "```"):
        text = text.removeprefix(prefix)
    text = text.removesuffix("```").strip()
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def format_title(response: str) -> bool:
    """A non-empty title in double angular brackets, such as ``<<poem of joy>>``."""
    return any(title.lstrip("<").rstrip(">").strip() for title in re.findall(r"<<[^\n]+>>", response))


def combination_two_responses(response: str) -> bool:
    """Exactly two different responses separated by ``******``."""
    parts = response.split("******")
    kept = []
    for index, part in enumerate(parts):
        if part.strip():
            kept.append(part.strip())
        elif index not in (0, len(parts) - 1):
            return False
    return len(kept) == 2 and kept[0] != kept[1]


def combination_repeat_prompt(response: str, *, prompt_to_repeat: str) -> bool:
    """The response starts with the request, repeated word for word (case-insensitive)."""
    return response.strip().lower().startswith(prompt_to_repeat.strip().lower())


def startend_end_checker(response: str, *, end_phrase: str) -> bool:
    """The response ends with ``end_phrase`` (case-insensitive, surrounding quotes ignored)."""
    return response.strip().strip('"').lower().endswith(end_phrase.strip().lower())


def startend_quotation(response: str) -> bool:
    """The whole response is wrapped in double quotation marks."""
    text = response.strip()
    return len(text) > 1 and text[0] == '"' and text[-1] == '"'


def punctuation_no_comma(response: str) -> bool:
    """No comma anywhere."""
    return "," not in response


CHECKERS: dict[str, Callable[..., bool]] = {
    "keywords:existence": keywords_existence,
    "keywords:frequency": keywords_frequency,
    "keywords:forbidden_words": keywords_forbidden_words,
    "keywords:letter_frequency": keywords_letter_frequency,
    "language:response_language": language_response_language,
    "length_constraints:number_sentences": length_number_sentences,
    "length_constraints:number_paragraphs": length_number_paragraphs,
    "length_constraints:number_words": length_number_words,
    "length_constraints:nth_paragraph_first_word": length_nth_paragraph_first_word,
    "detectable_content:number_placeholders": content_number_placeholders,
    "detectable_content:postscript": content_postscript,
    "detectable_format:number_bullet_lists": format_number_bullet_lists,
    "detectable_format:constrained_response": format_constrained_response,
    "detectable_format:number_highlighted_sections": format_number_highlighted_sections,
    "detectable_format:multiple_sections": format_multiple_sections,
    "detectable_format:json_format": format_json_format,
    "detectable_format:title": format_title,
    "combination:two_responses": combination_two_responses,
    "combination:repeat_prompt": combination_repeat_prompt,
    "startend:end_checker": startend_end_checker,
    "change_case:capital_word_frequency": change_case_capital_word_frequency,
    "change_case:english_capital": change_case_english_capital,
    "change_case:english_lowercase": change_case_english_lowercase,
    "punctuation:no_comma": punctuation_no_comma,
    "startend:quotation": startend_quotation,
}
"""IFEval instruction id -> checker ``(response, **kwargs) -> bool``."""
