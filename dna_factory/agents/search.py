"""Search Agent environment: BM25 search over a corpus, indexed once with ``bm25s``.

``search(query)`` returns the ``top_k`` passages with a positive BM25 score (Okapi BM25, ``k1 =
1.5``, ``b = 0.75``, English stopwords removed, no stemming), each as ``[rank] title`` and the
passage text cut to ``max_passage_chars``. Pair it with a string-match reward on the final
answer (``{factory: string_match, extractor: boxed, answer_column: answer}``).

The corpus is a local JSON Lines file (one passage per line: ``{"id", "title", "text"}``) or
anything ``datasets.load_dataset`` reads (a Parquet/JSON file, a ``save_to_disk`` folder, a
Hub id with ``corpus_name`` and ``corpus_split``), with the passage in ``text_column`` and an
optional title in ``title_column``. The index is built once per process and corpus (about 1 s
per 10^5 short passages) and shared by every rollout. ``bm25s`` 0.3.16 needs only numpy.

Example:
    >>> env = SearchEnvironment(corpus="data/agents/search_corpus.jsonl", top_k=1, max_passage_chars=60)
    >>> print(env.search("Which river flows through Marrowgate?"))
    [1] Marrowgate
    Marrowgate is the capital of Veloria. The river Ashwen flows ...
"""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dna_factory.agents.environment import Environment, tool
from dna_factory.errors import DnaConfigError

logger = logging.getLogger(__name__)

DEFAULT_CORPUS = "data/agents/search_corpus.jsonl"
BM25S_PIN = "bm25s==0.3.16"


@dataclass(frozen=True)
class Passage:
    """One corpus entry."""

    title: str
    text: str


class BM25Index:
    """A ``bm25s`` index over passages (title and text are indexed together).

    Args:
        passages: The corpus.
    """

    def __init__(self, passages: list[Passage]) -> None:
        import bm25s

        self.passages = passages
        tokens = bm25s.tokenize(
            [f"{p.title}\n{p.text}" for p in passages], stopwords="en", show_progress=False
        )
        self.retriever = bm25s.BM25()
        self.retriever.index(tokens, show_progress=False)

    def search(self, query: str, k: int) -> list[tuple[Passage, float]]:
        """The best ``k`` passages with a positive score, best first."""
        import bm25s

        terms = bm25s.tokenize([query], stopwords="en", return_ids=False, show_progress=False)
        if not terms or not terms[0]:
            return []
        ids, scores = self.retriever.retrieve(terms, k=min(k, len(self.passages)), show_progress=False)
        return [(self.passages[int(i)], float(s)) for i, s in zip(ids[0], scores[0], strict=True) if s > 0]


def _is_local_jsonl(corpus: str) -> bool:
    return corpus.endswith(".jsonl") and Path(corpus).expanduser().is_file()


def _read_passages(
    corpus: str, corpus_name: str | None, corpus_split: str, text_column: str, title_column: str | None
) -> list[Passage]:
    if _is_local_jsonl(corpus):
        rows = [
            json.loads(line)
            for line in Path(corpus).expanduser().read_text(encoding="utf-8").splitlines()
            if line.strip()
        ]
    else:
        import datasets

        path = Path(corpus).expanduser()
        if path.is_dir() and (path / "dataset_info.json").is_file():
            rows = datasets.load_from_disk(str(path))
        elif path.is_file():
            builder = {".parquet": "parquet", ".json": "json", ".jsonl": "json"}.get(path.suffix, "json")
            rows = datasets.load_dataset(builder, data_files=str(path), split="train")
        else:
            rows = datasets.load_dataset(corpus, corpus_name, split=corpus_split)
    passages = []
    for index, row in enumerate(rows):
        text = row.get(text_column)
        if not isinstance(text, str):
            raise DnaConfigError(
                f"Corpus {corpus!r} row {index} has no text column {text_column!r} (columns: {', '.join(row)}). "
                "Set environment_options.text_column."
            )
        title = row.get(title_column) if title_column else None
        passages.append(Passage(str(title) if title is not None else "", text))
    if not passages:
        raise DnaConfigError(f"Corpus {corpus!r} is empty. Give it at least one passage.")
    return passages


@functools.lru_cache(maxsize=4)
def load_index(
    corpus: str, corpus_name: str | None, corpus_split: str, text_column: str, title_column: str | None
) -> BM25Index:
    """The BM25 index of a corpus, built on first use and cached per process."""
    passages = _read_passages(corpus, corpus_name, corpus_split, text_column, title_column)
    index = BM25Index(passages)
    logger.info("Search index: %d passages from %s.", len(passages), corpus)
    return index


class SearchEnvironment(Environment):
    """BM25 search over a corpus.

    Args:
        corpus: A local ``.jsonl`` file of passages, another local dataset file or folder, or a Hub id.
        corpus_name: The Hub dataset's config name, if it has several.
        corpus_split: The split to index.
        text_column: The column holding the passage text.
        title_column: The column holding its title; None for none.
        top_k: Passages returned per search.
        max_passage_chars: Characters of each passage shown to the model.
    """

    def __init__(
        self,
        corpus: str = DEFAULT_CORPUS,
        corpus_name: str | None = None,
        corpus_split: str = "train",
        text_column: str = "text",
        title_column: str | None = "title",
        top_k: int = 3,
        max_passage_chars: int = 600,
    ) -> None:
        self.check_options(dict(corpus=corpus, top_k=top_k, max_passage_chars=max_passage_chars))
        self.index = load_index(corpus, corpus_name, corpus_split, text_column, title_column)
        self.top_k = top_k
        self.max_passage_chars = max_passage_chars

    @classmethod
    def check_options(cls, options: Mapping[str, Any]) -> None:
        if importlib.util.find_spec("bm25s") is None:
            raise DnaConfigError(
                f"The search environment needs the bm25s package, which is not installed. pip install {BM25S_PIN}."
            )
        corpus = str(options.get("corpus", DEFAULT_CORPUS))
        looks_local = corpus.startswith((".", "/", "~")) or Path(corpus).suffix in (
            ".jsonl",
            ".json",
            ".parquet",
        )
        if looks_local and not Path(corpus).expanduser().exists():
            raise DnaConfigError(
                f"Search corpus {corpus!r} does not exist. Point environment_options.corpus at a JSONL file of "
                "passages (python scripts/make_agent_data.py writes data/agents/search_corpus.jsonl) or a Hub id."
            )
        for key in ("top_k", "max_passage_chars"):
            if key in options and not options[key] > 0:
                raise DnaConfigError(f"environment_options.{key} must be above 0, not {options[key]!r}.")

    @tool
    def search(self, query: str) -> str:
        """Search the document collection and return the best matching passages.

        Args:
            query: Keywords or a question, e.g. "founding year of Marrowgate".
        """
        if not query.strip():
            raise ValueError("the query is empty; give keywords to search for")
        hits = self.index.search(query, self.top_k)
        if not hits:
            return f"No passage matches {query!r}. Try other keywords."
        blocks = []
        for rank, (passage, _) in enumerate(hits, start=1):
            text = (
                passage.text
                if len(passage.text) <= self.max_passage_chars
                else passage.text[: self.max_passage_chars].rstrip() + " ..."
            )
            blocks.append(f"[{rank}] {passage.title}\n{text}" if passage.title else f"[{rank}]\n{text}")
        return "\n\n".join(blocks)
