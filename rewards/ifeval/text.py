"""Text measurements the IFEval checkers share: words, sentences, capital words, language.

They follow Google's IFEval reference (``instruction_following_eval/instructions_util.py``,
Apache-2.0) where it is self-contained, and replace its two data-dependent parts:

- sentences are split with the reference's own rule-based splitter (``split_into_sentences``,
  reimplemented below) instead of NLTK's Punkt model, so no NLTK data is needed offline;
- words in ``change_case:capital_word_frequency`` are regex tokens (hyphenated and dotted words
  stay whole, as NLTK's ``word_tokenize`` keeps them) instead of NLTK tokens.

Language detection uses ``langdetect`` (as the reference does), seeded for determinism and
imported on first use.

Example:
    >>> count_words("Hello, world! It's 2 a.m."), count_sentences("Dr. Smith came. He left!")
    (7, 2)
"""

from __future__ import annotations

import re
import threading

_ALPHABETS = "([A-Za-z])"
_PREFIXES = "(Mr|St|Mrs|Ms|Dr)[.]"
_SUFFIXES = "(Inc|Ltd|Jr|Sr|Co)"
_STARTERS = (
    r"(Mr|Mrs|Ms|Dr|Prof|Capt|Cpt|Lt|He\s|She\s|It\s|They\s|Their\s|Our\s|We\s|But\s|However\s|That\s"
    r"|This\s|Wherever)"
)
_ACRONYMS = "([A-Z][.][A-Z][.](?:[A-Z][.])?)"
_WEBSITES = "[.](com|net|org|io|gov|edu|me)"
_DIGITS = "([0-9])"
_MULTIPLE_DOTS = r"\.{2,}"
_WORD = re.compile(r"\w+")
_TOKEN = re.compile(r"\w+(?:[-'.]\w+)*")

_langdetect_lock = threading.Lock()


def count_words(text: str) -> int:
    """Number of ``\\w+`` runs (the reference's ``RegexpTokenizer(r"\\w+")``).

    Example:
        >>> count_words("state-of-the-art, isn't it?")
        7
    """
    return len(_WORD.findall(text))


def split_sentences(text: str) -> list[str]:
    """Sentences of ``text`` by IFEval's rule-based splitter (titles, acronyms, decimals, URLs).

    Example:
        >>> split_sentences("Mr. Smith paid 3.50 dollars. Was it on shop.com? Yes!")
        ['Mr. Smith paid 3.50 dollars.', 'Was it on shop.com?', 'Yes!']
    """
    text = " " + text + "  "
    text = text.replace("\n", " ")
    text = re.sub(_PREFIXES, "\\1<prd>", text)
    text = re.sub(_WEBSITES, "<prd>\\1", text)
    text = re.sub(_DIGITS + "[.]" + _DIGITS, "\\1<prd>\\2", text)
    text = re.sub(_MULTIPLE_DOTS, lambda match: "<prd>" * len(match.group(0)) + "<stop>", text)
    if "Ph.D" in text:
        text = text.replace("Ph.D.", "Ph<prd>D<prd>")
    text = re.sub(r"\s" + _ALPHABETS + "[.] ", " \\1<prd> ", text)
    text = re.sub(_ACRONYMS + " " + _STARTERS, "\\1<stop> \\2", text)
    text = re.sub(
        _ALPHABETS + "[.]" + _ALPHABETS + "[.]" + _ALPHABETS + "[.]", "\\1<prd>\\2<prd>\\3<prd>", text
    )
    text = re.sub(_ALPHABETS + "[.]" + _ALPHABETS + "[.]", "\\1<prd>\\2<prd>", text)
    text = re.sub(" " + _SUFFIXES + "[.] " + _STARTERS, " \\1<stop> \\2", text)
    text = re.sub(" " + _SUFFIXES + "[.]", " \\1<prd>", text)
    text = re.sub(" " + _ALPHABETS + "[.]", " \\1<prd>", text)
    for closing in ("”", '"'):
        text = text.replace("." + closing, closing + ".")
    text = text.replace('!"', '"!').replace('?"', '"?')
    text = text.replace(".", ".<stop>").replace("?", "?<stop>").replace("!", "!<stop>")
    text = text.replace("<prd>", ".")
    return [sentence.strip() for sentence in text.split("<stop>") if sentence.strip()]


def count_sentences(text: str) -> int:
    """Number of non-empty sentences from :func:`split_sentences`.

    Example:
        >>> count_sentences("One. Two? Three!")
        3
    """
    return len(split_sentences(text))


def capital_words(text: str) -> list[str]:
    """Tokens written all in capitals (``I`` and ``U.S.`` count; digits alone do not).

    Example:
        >>> capital_words("WOW, the U.S. team is STATE-OF-THE-ART and I agree 100%")
        ['WOW', 'U.S', 'STATE-OF-THE-ART', 'I']
    """
    return [token for token in _TOKEN.findall(text) if token.isupper()]


def detect_language(text: str) -> str | None:
    """ISO 639-1 code of ``text``'s language by ``langdetect`` (seed 0), or None if undetectable.

    Raises:
        ImportError: When ``langdetect`` is not installed, which the language checks need.

    Example:
        >>> detect_language("This is a plain English sentence about the weather today.")
        'en'
    """
    try:
        import langdetect
    except ImportError as exc:
        raise ImportError(
            "The IFEval language checks (language:response_language, change_case:english_*) need "
            "langdetect, which is not installed. Install it: pip install langdetect==1.0.9."
        ) from exc
    with _langdetect_lock:  # its factory and seed are process-global
        langdetect.DetectorFactory.seed = 0
        try:
            return langdetect.detect(text)
        except langdetect.LangDetectException:
            return None
