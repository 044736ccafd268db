"""The narrow channel between the program's interpreter and the tests' interpreter (standard library only).

With tests, :mod:`rewards.sandbox.boot` runs the program in one sandboxed process and the tests in another
that never executes the program's code. The test side sees the program's globals as :class:`Remote`
proxies (modules the program imported are the test side's own copies, from the standard library or
``site-packages``): calling one, reading an attribute, iterating, ``len``, ``[]``, ``bool`` and ``str`` are
requests over a pipe, answered by :func:`serve` in the program's process (``in`` iterates, so the test side
compares each item itself). Only plain values cross, as
newline-delimited JSON with tags, and each is rebuilt on the test side from the standard types:

``None``, ``bool``, ``int``, ``float``, ``complex``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``,
``set``, ``frozenset``, ``range``, ``fractions.Fraction``, ``decimal.Decimal``

(subclasses cross as their base type, so a namedtuple arrives as a tuple and a ``Counter`` as a dict; a
numpy scalar crosses as its Python value). Anything else the program hands over (its own classes' instances,
functions, generators) crosses as an opaque handle: a :class:`Remote` that is equal only to itself, so an
object whose ``__eq__`` always says yes never meets the test's expected value. Exceptions cross as their
type name and message, rebuilt as the built-in exception of that name or as :class:`ProgramError`.

A value the test side cannot send (a lambda, a file) raises ``TypeError`` in that test; an answer larger
than :data:`MAX_MESSAGE_BYTES` or nested deeper than :data:`MAX_DEPTH` fails that call. Mutations the
program makes to an argument stay on its side.

Example:
    >>> decode(json.loads(json.dumps(encode((1, {2: b"x"}, {3.5})))), None)
    (1, {2: b'x'}, {3.5})
"""

from __future__ import annotations

import ast
import base64
import builtins
import contextlib
import decimal
import fractions
import json
import math
import operator
import os
import select
import types
from typing import Any

MAX_MESSAGE_BYTES = 16 << 20
"""The largest request or answer, in bytes of JSON."""
MAX_DEPTH = 100
"""How deeply nested a value may be."""
_BIG_INT = 1 << 63
_DUNDERS = {
    "__iter__": iter,
    "__next__": next,
    "__len__": len,
    "__getitem__": operator.getitem,
    "__bool__": bool,
    "__str__": str,
}
"""The operations on a program object the test side may ask for (besides calls and attributes)."""


class CannotCross(TypeError):
    """A value that is not plain (and not a program object the other side handed over)."""


class ProgramError(Exception):
    """An exception the program raised whose type is not a built-in exception."""


class ProgramGone(RuntimeError):
    """The program's process exited, crashed or broke the protocol; every later call fails too."""


def encode(value: Any, handles: Handles | None = None, depth: int = 0) -> Any:
    """``value`` as JSON-ready data; non-plain objects become handles when ``handles`` is given.

    Raises:
        CannotCross: A non-plain value without ``handles``, or nesting past :data:`MAX_DEPTH`.
    """
    if depth > MAX_DEPTH:
        raise CannotCross(f"value nested deeper than {MAX_DEPTH}")
    if value is None or value is True or value is False:
        return value
    if isinstance(value, Remote):
        return {"handle": value._handle}
    if isinstance(value, int):
        value = int(value)
        return value if -_BIG_INT < value < _BIG_INT else {"int": hex(value)}
    if isinstance(value, float):
        value = float(value)
        return value if math.isfinite(value) else {"float": repr(value)}
    if isinstance(value, str):
        return str(value)
    if isinstance(value, (bytes, bytearray)):
        return {"bytes": base64.b64encode(bytes(value)).decode("ascii")}
    if isinstance(value, complex):
        return {"complex": [encode(value.real), encode(value.imag)]}
    if isinstance(value, fractions.Fraction):
        return {"fraction": [encode(value.numerator), encode(value.denominator)]}
    if isinstance(value, decimal.Decimal):
        return {"decimal": str(value)}
    if isinstance(value, range):
        return {"range": [encode(value.start), encode(value.stop), encode(value.step)]}
    if handles is not None and type(value).__module__ == "numpy" and getattr(value, "shape", None) == ():
        item = value.item()  # a numpy scalar (np.int64 from np.sum): its Python value
        if type(item) in (bool, int, float, complex, str, bytes):
            return encode(item)
    inner = depth + 1
    if isinstance(value, list):
        return [encode(item, handles, inner) for item in list.__iter__(value)]
    if isinstance(value, tuple):
        return {"tuple": [encode(item, handles, inner) for item in tuple.__iter__(value)]}
    if isinstance(value, dict):
        return {
            "dict": [[encode(k, handles, inner), encode(v, handles, inner)] for k, v in dict.items(value)]
        }
    if isinstance(value, (set, frozenset)):
        tag = "frozenset" if isinstance(value, frozenset) else "set"
        return {tag: [encode(item, handles, inner) for item in frozenset.__iter__(frozenset(value))]}
    if handles is None:
        raise CannotCross(f"a {type(value).__name__} cannot cross the sandbox channel (plain values only)")
    return {"handle": handles.add(value)}


def decode(data: Any, resolve: Any, depth: int = 0) -> Any:
    """Rebuild a value from :func:`encode`'s data with the standard types; ``resolve(n)`` makes handle ``n``."""
    if depth > MAX_DEPTH:
        raise CannotCross(f"value nested deeper than {MAX_DEPTH}")
    if data is None or isinstance(data, (bool, int, float, str)):
        return data
    inner = depth + 1
    if isinstance(data, list):
        return [decode(item, resolve, inner) for item in data]
    if not isinstance(data, dict) or len(data) != 1:
        raise CannotCross("malformed value on the sandbox channel")
    ((tag, body),) = data.items()
    if tag == "int" and isinstance(body, str):
        return int(body, 16)
    if tag == "float" and body in ("inf", "-inf", "nan"):
        return float(body)
    if tag == "bytes" and isinstance(body, str):
        return base64.b64decode(body, validate=True)
    if tag == "complex" and isinstance(body, list) and len(body) == 2:
        return complex(*(float(decode(part, resolve, inner)) for part in body))
    if tag == "decimal" and isinstance(body, str):
        return decimal.Decimal(body)
    if tag in ("fraction", "range") and isinstance(body, list) and all(type(part) is int for part in body):
        return fractions.Fraction(*body) if tag == "fraction" else range(*body)
    if tag == "handle" and isinstance(body, int) and resolve is not None:
        return resolve(body)
    if isinstance(body, list):
        if tag == "tuple":
            return tuple(decode(item, resolve, inner) for item in body)
        if tag == "set":
            return {decode(item, resolve, inner) for item in body}
        if tag == "frozenset":
            return frozenset(decode(item, resolve, inner) for item in body)
        if tag == "dict" and all(isinstance(pair, list) and len(pair) == 2 for pair in body):
            return {decode(k, resolve, inner): decode(v, resolve, inner) for k, v in body}
    raise CannotCross(f"malformed value on the sandbox channel (tag {tag!r})")


def shadows_for(test: str, program_names: Any, shadows: Any) -> set[str]:
    """Which program globals that shadow a built-in a test sees: at most one, the function under test.

    The tests see the real built-ins, so a program cannot answer for ``set``, ``sorted`` or ``abs`` inside an
    assert about another function. The exception is a function under test that has a built-in's name: MBPP's
    ``def sum(a, b)`` with ``assert sum(10, 15) == 6``, or a HumanEval entry point passed as
    ``check(sum)``. A shadowing name is visible when the test's top-level asserts call no other program
    function and, of the shadowing names they call, exactly one is innermost (called with no shadowing call
    inside its arguments): in ``set(filter(xs)) == set([2])`` that is ``filter``, and ``set`` stays built in.

    Example:
        >>> sorted(shadows_for("assert sum(10, 15) == 6", {"helper"}, {"sum"}))
        ['sum']
        >>> shadows_for("assert set(f(1)) == set([1])", {"f"}, {"set"})
        set()
        >>> sorted(shadows_for("assert abs(max([1, 3]) - 3) < 1e-9", set(), {"max", "abs"}))
        ['max']
    """
    try:
        tree = ast.parse(test)
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return set()
    shadows, program_names = set(shadows), set(program_names)
    passed = {  # check(sum): the HumanEval line parse_tests appends
        arg.id
        for statement in tree.body
        if isinstance(statement, ast.Expr) and isinstance(statement.value, ast.Call)
        for arg in statement.value.args
        if isinstance(arg, ast.Name) and arg.id in shadows
    }
    calls = [
        node
        for statement in tree.body
        if isinstance(statement, ast.Assert)
        for node in ast.walk(statement)
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
    ]
    if any(node.func.id in program_names for node in calls):
        return passed if len(passed) == 1 else set()

    def shadow_call_inside(node: ast.Call) -> bool:
        return any(
            isinstance(inner, ast.Call) and isinstance(inner.func, ast.Name) and inner.func.id in shadows
            for argument in (*node.args, *(keyword.value for keyword in node.keywords))
            for inner in ast.walk(argument)
        )

    innermost = {node.func.id for node in calls if node.func.id in shadows and not shadow_call_inside(node)}
    chosen = innermost | passed
    return chosen if len(chosen) == 1 else set()


def _dump(message: dict) -> bytes:
    line = json.dumps(message, separators=(",", ":")).encode("ascii") + b"\n"
    if len(line) > MAX_MESSAGE_BYTES:
        raise CannotCross(f"value larger than {MAX_MESSAGE_BYTES} bytes of JSON")
    return line


class Handles:
    """The program side's table of objects handed over as handles (kept alive until the run ends)."""

    def __init__(self) -> None:
        self._objects: list[Any] = []
        self._numbers: dict[int, int] = {}

    def add(self, value: Any) -> int:
        number = self._numbers.get(id(value))
        if number is None:
            number = len(self._objects)
            self._objects.append(value)
            self._numbers[id(value)] = number
        return number

    def get(self, number: int) -> Any:
        if not isinstance(number, int) or not 0 <= number < len(self._objects):
            raise CannotCross(f"no program object #{number}")
        return self._objects[number]


def _answer(result: Any, handles: Handles) -> bytes:
    try:
        return _dump({"ok": encode(result, handles)})
    except (CannotCross, RecursionError, ValueError) as exc:
        return _dump({"raise": "TypeError", "message": f"the answer cannot cross the sandbox channel: {exc}"})


def _describe(exc: BaseException) -> bytes:
    try:
        message = str(exc)[:2000]
    except Exception:  # noqa: BLE001 - a program's exception whose __str__ raises
        message = ""
    return _dump({"raise": type(exc).__name__[:200], "message": message})


def serve(namespace: dict, requests: int, answers: int, report: Any = None) -> None:
    """The program side: announce the program's globals, then answer requests until the test side closes.

    Runs in the program's process after the program ran. ``requests`` and ``answers`` are pipe descriptors;
    ``report(exc)`` is told of every exception a call raised (the sandbox reports limits from it).
    """
    handles = Handles()
    names = {}
    for name, value in list(namespace.items()):
        if name.startswith("__"):
            continue
        if isinstance(value, types.ModuleType):
            names[name] = {"module": getattr(value, "__name__", "")}
            continue
        try:
            encoded = encode(value, handles)
            if len(json.dumps(encoded)) > MAX_MESSAGE_BYTES // 4:
                raise CannotCross("too large")
        except (CannotCross, RecursionError, ValueError):
            encoded = {"handle": handles.add(value)}
        names[name] = {"value": encoded}
    reader = os.fdopen(requests, "rb")
    writer = os.fdopen(answers, "wb", buffering=0)
    writer.write(_dump({"globals": names}))
    while line := reader.readline(MAX_MESSAGE_BYTES + 1):
        try:
            request = json.loads(line)
            target = handles.get(request["target"])
            args = [decode(arg, handles.get) for arg in request.get("args", ())]
            kwargs = {str(k): decode(v, handles.get) for k, v in request.get("kwargs", ())}
            if request["op"] == "call":
                result = target(*args, **kwargs)
            elif request["op"] == "getattr":
                result = getattr(target, str(request["name"]))
            else:
                result = _DUNDERS[request["op"]](target, *args)
        except SystemExit:
            raise
        except BaseException as exc:  # noqa: BLE001 - the program's exception is an answer to the call
            if report is not None:
                report(exc)
            answer = _describe(exc)
        else:
            answer = _answer(result, handles)
        writer.write(answer)


class Link:
    """The test side of the channel: sends requests, rebuilds answers, keeps one :class:`Remote` per handle."""

    def __init__(self, requests: int, answers: int, modules: Any, watch: Any = None) -> None:
        """``modules``: :mod:`rewards.sandbox.trusted` (passed in: boot.py loads both files by path). ``watch``:
        ``(fd, read)``, a descriptor served while the tests wait for an answer (``read()`` when it is ready;
        False: done with it), so what the program's process reports meanwhile is passed on as it comes."""
        self._modules = modules
        self._writer = os.fdopen(requests, "wb", buffering=0)
        self._answers = answers
        self._buffer = bytearray()
        self._watch = watch if watch is not None and watch[0] >= 0 else None
        self._remotes: dict[int, Remote] = {}
        self._gone: str | None = None

    def _line(self) -> bytes:
        """The program's next line: at most ``MAX_MESSAGE_BYTES + 1`` bytes, without a newline at the end when
        the program went away (end-of-file) or sent more."""
        while True:
            end = self._buffer.find(b"\n", 0, MAX_MESSAGE_BYTES + 1)
            if end >= 0 or len(self._buffer) > MAX_MESSAGE_BYTES:
                size = end + 1 if end >= 0 else MAX_MESSAGE_BYTES + 1
                line = bytes(self._buffer[:size])
                del self._buffer[:size]
                return line
            if self._watch is not None:
                fd, read = self._watch
                ready = select.select([self._answers, fd], [], [])[0]
                if fd in ready and not read():
                    self._watch = None
                if self._answers not in ready:
                    continue
            chunk = os.read(self._answers, 1 << 16)
            if not chunk:
                return bytes(self._buffer)
            self._buffer += chunk

    def _receive(self) -> dict:
        if self._gone is not None:
            raise ProgramGone(self._gone)
        line = self._line()
        if not line.endswith(b"\n"):
            self._gone = (
                "the program's process exited or crashed"
                if len(line) <= MAX_MESSAGE_BYTES
                else f"the program sent more than {MAX_MESSAGE_BYTES} bytes in one answer"
            )
            raise ProgramGone(self._gone)
        try:
            message = json.loads(line)
        except (ValueError, RecursionError) as exc:
            self._gone = f"the program broke the channel protocol: {exc}"
            raise ProgramGone(self._gone) from None
        if not isinstance(message, dict):
            self._gone = "the program broke the channel protocol"
            raise ProgramGone(self._gone)
        return message

    def remote(self, number: int) -> Remote:
        if not isinstance(number, int) or number < 0:
            raise CannotCross("malformed handle")
        if number not in self._remotes:
            self._remotes[number] = Remote(self, number)
        return self._remotes[number]

    def close(self) -> None:
        """Close both pipes: the program side reads end-of-file and stops answering."""
        with contextlib.suppress(OSError):
            self._writer.close()
        if self._answers >= 0:
            with contextlib.suppress(OSError):
                os.close(self._answers)
            self._answers = -1

    def globals(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """The program's globals as the tests see them, and apart from them those that shadow a built-in or a
        standard-library module (see :func:`shadows_for`); raises :class:`ProgramGone` if the program did not
        load."""
        message = self._receive()
        names = message.get("globals")
        if not isinstance(names, dict):
            raise ProgramGone("the program did not load")
        result: dict[str, Any] = {}
        shadows: dict[str, Any] = {}
        for name, entry in names.items():
            if not isinstance(name, str) or not name.isidentifier() or name.startswith("__"):
                continue
            module = entry.get("module") if isinstance(entry, dict) else None
            if isinstance(module, str):  # the test side's own copy of a standard-library or installed module
                found = self._modules.trusted_module(module)
                if found is not None:
                    result[name] = found
                continue
            try:
                value = decode(entry.get("value") if isinstance(entry, dict) else None, self.remote)
            except (CannotCross, RecursionError, ValueError, TypeError):
                continue
            if self._modules.shadows_a_module(name):
                # Shadows a built-in, a standard-library module (a fake ``math``) or a third-party module's usual
                # name (a fake ``np`` whose allclose says yes): visible only as a function under test
                # (shadows_for); otherwise the tests get the real one.
                shadows[name] = value
                found = self._modules.real_module(name)
                if found is not None:
                    result[name] = found
            else:
                result[name] = value
        return result, shadows

    def request(
        self, op: str, target: int, args: tuple = (), kwargs: dict | None = None, name: str = ""
    ) -> Any:
        message = {"op": op, "target": target, "args": [encode(arg) for arg in args]}
        if kwargs:
            message["kwargs"] = [[key, encode(value)] for key, value in kwargs.items()]
        if name:
            message["name"] = name
        line = _dump(message)
        if self._gone is not None:
            raise ProgramGone(self._gone)
        try:
            self._writer.write(line)
        except OSError:
            self._gone = "the program's process exited or crashed"
            raise ProgramGone(self._gone) from None
        answer = self._receive()
        if "ok" in answer:
            try:
                return decode(answer["ok"], self.remote)
            except (CannotCross, RecursionError, ValueError, TypeError) as exc:
                raise CannotCross(f"the program's answer cannot be rebuilt: {exc}") from None
        name = str(answer.get("raise", "Exception"))
        text = str(answer.get("message", ""))
        kind = getattr(builtins, name, None)
        rebuilt = None
        if kind is StopIteration and op != "__next__":
            kind = None  # would end the caller's loop (all(), any(), a generator) as if the program had no answer
        if isinstance(kind, type) and issubclass(kind, Exception):
            try:
                rebuilt = kind(text)
            except Exception:  # noqa: BLE001 - a built-in exception with other arguments (UnicodeDecodeError)
                rebuilt = None
        raise rebuilt if rebuilt is not None else ProgramError(f"{name}: {text}")


class Remote:
    """A program object on the test side: equal only to itself; calls and a few operations go to the program."""

    __slots__ = ("_handle", "_link")

    def __init__(self, link: Link, handle: int) -> None:
        object.__setattr__(self, "_link", link)
        object.__setattr__(self, "_handle", handle)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._link.request("call", self._handle, args, kwargs)

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        return self._link.request("getattr", self._handle, name=name)

    def __iter__(self) -> Any:
        return self._link.request("__iter__", self._handle)

    def __next__(self) -> Any:
        return self._link.request("__next__", self._handle)

    def __len__(self) -> int:
        value = self._link.request("__len__", self._handle)
        if type(value) is not int:
            raise TypeError("len() of a program object did not return an int")
        return value

    def __getitem__(self, key: Any) -> Any:
        return self._link.request("__getitem__", self._handle, (key,))

    def __bool__(self) -> bool:
        return self._link.request("__bool__", self._handle) is True

    def __str__(self) -> str:
        value = self._link.request("__str__", self._handle)
        return value if type(value) is str else ""

    def __repr__(self) -> str:
        return f"<program object #{self._handle}>"
