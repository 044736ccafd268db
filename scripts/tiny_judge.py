"""A small deterministic judge server for the families recipe's RLHF stage (docs/families.md).

It speaks the part of the OpenAI API that the judge reward (``rewards/generative.py``) uses: ``GET /health``,
``GET /v1/models`` and ``POST /v1/chat/completions``. It reads the QUESTION and the RESPONSE out of the
rubric the reward sends (``rewards/prompts/default.md``) and grades the way that rubric asks, for the one kind
of question the tiny task has, "Which number is smallest: 5, 7, 0, 2?" (or largest):

* 9: the right number in a full sentence that says what it is ("The smallest number is 0.", or one that restates
  the list: "The smallest of 5, 7, 0, 2 is 0.");
* 6: the right number alone ("0" or "The answer is 0."): correct, but a careful reader wants the question
  answered in full;
* 3: anything else whose last number is right ("The smallest of 1, 0, 4, 6 is 0, 1, 0", which a policy found
  when the full answer only had to appear somewhere in the response);
* 1: a wrong number, no number, or a question of another kind.

The reward binarises at 7, so only the full answer earns 1.0: a preference between two correct answers that a
tiny model can learn, and that needs no model on the judge's side. Every reply ends with ``Score: N``, except
with ``--abstain-every N``: then every N-th request gets a reply with no score (a judge that cannot decide), for
which the judge reward gives None, never 0 (tests/test_families.py checks a real rlhf run against it).

Usage::

    python scripts/tiny_judge.py      # port 8001: the judge reward's default JUDGE_BASE_URL, http://localhost:8001/v1
    python scripts/tiny_judge.py --port 0 --abstain-every 3    # any free port; every third reply has no score
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

MODEL = "tiny-judge"
QUESTION = re.compile(r"Which number is (largest|smallest): ((?:\d, )*\d)\?")


def grade(question: str, response: str) -> int:
    """The score (0-10) of ``response`` to ``question`` under the rules of the module docstring."""
    asked = QUESTION.search(question)
    if asked is None:
        return 1
    kind, listed = asked.groups()
    digits = [int(d) for d in listed.split(", ")]
    right = max(digits) if kind == "largest" else min(digits)
    said = " ".join(response.split()).lower().rstrip(".")
    if said in (f"the {kind} number is {right}", f"the {kind} of {listed} is {right}"):
        return 9
    if said in (str(right), f"the answer is {right}"):
        return 6
    numbers = re.findall(r"-?\d+", response)
    return 3 if numbers and int(numbers[-1]) == right else 1


def split_rubric(text: str) -> tuple[str, str]:
    """The QUESTION and RESPONSE sections of a rendered rubric (the text between the headers)."""
    _, _, rest = text.partition("QUESTION:\n")
    question, _, rest = rest.partition("\n\nRESPONSE:\n")
    response = rest.rsplit("\n\nYou may think first", 1)[0]
    return question, response


ABSTAIN = "I cannot tell which answer the question wants."
"""The reply with no score that ``--abstain-every`` sends."""


class Handler(BaseHTTPRequestHandler):
    abstain_every = 0
    """Reply with :data:`ABSTAIN` to every N-th chat request (0: never)."""
    _count = itertools.count(1)
    _lock = threading.Lock()

    def _send(self, status: int, body: dict) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/health":
            self._send(200, {})
        elif self.path == "/v1/models":
            self._send(200, {"object": "list", "data": [{"id": MODEL, "object": "model"}]})
        else:
            self._send(404, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:  # noqa: N802
        if self.path != "/v1/chat/completions":
            self._send(404, {"error": f"no route {self.path}"})
            return
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
        messages = body.get("messages") or []
        text = str(messages[-1].get("content", "")) if messages else ""
        with self._lock:
            number = next(self._count)
        abstains = self.abstain_every and number % self.abstain_every == 0
        reply = ABSTAIN if abstains else f"Score: {grade(*split_rubric(text))}"
        self._send(
            200,
            {
                "id": f"judge-{time.monotonic_ns()}",
                "object": "chat.completion",
                "model": MODEL,
                "choices": [
                    {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                ],
            },
        )

    def log_message(self, format: str, *args) -> None:  # noqa: A002 (http.server's name)
        pass  # one line per request would drown the pipeline's log


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description="The families recipe's deterministic judge (docs/families.md)."
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8001, help="0: any free port (printed)")
    parser.add_argument(
        "--abstain-every", type=int, default=0, metavar="N", help="reply with no score to every N-th request"
    )
    args = parser.parse_args(argv)
    Handler.abstain_every = args.abstain_every
    server = ThreadingHTTPServer((args.host, args.port), Handler)
    print(f"tiny judge on http://{args.host}:{server.server_port}/v1", flush=True)
    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C ends it quietly
        server.serve_forever()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
