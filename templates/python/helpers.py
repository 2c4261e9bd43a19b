"""Typed helpers over leasehold's host functions: each effect takes and
returns Python values instead of JSON strings, and fails with an
EffectError subclass that says which effect failed and how. Every call is
recorded in the run's ledger and replayed when the run resumes, so make the
same calls in the same order every time (see wit/turn.wit).

Shipped with `leasehold new --lang python`.
"""

import json

from wit_world.imports import host
from wit_world.imports.host import EffectError_Denied, EffectError_Failed, EffectError_InDoubt
from componentize_py_types import Err


class EffectError(Exception):
    """Why an effect gave no result. Catch it in `run` and raise
    Err(str(e)) to end the run with its message (as the template does); any
    exception that escapes `run` traps, and the run's error shows its
    traceback."""

    def __init__(self, effect, message):
        super().__init__(f"{effect}: {message}")
        self.effect = effect
        self.message = message


class Failed(EffectError):
    """The provider ran and failed (an HTTP error status, a bad request)."""


class InDoubt(EffectError):
    """An unkeyed effect was started by a segment that died: it may or may
    not have happened, and is never re-issued."""


class Denied(EffectError):
    """Refused without being performed (not allowed, over a cap)."""


def effect(name, request):
    """Performs effect `name` with a JSON-able request; returns its result."""
    try:
        result = host.effect(name, json.dumps(request, ensure_ascii=False, separators=(",", ":")))
    except Err as e:
        error = e.value
        kind = {EffectError_Failed: Failed, EffectError_InDoubt: InDoubt, EffectError_Denied: Denied}.get(type(error), Failed)
        raise kind(name, getattr(error, "value", str(error))) from None
    return json.loads(result)


def emit(text):
    """Appends text to the turn's streamed output."""
    host.emit(text)


def wait_input(prompt):
    """Suspends the run until someone delivers input, and returns it."""
    return host.wait_input(prompt)


def sleep_ms(ms):
    """A durable timer: the run is suspended for `ms` milliseconds."""
    host.sleep(ms)


def log(message):
    """Writes a line to the host's log (not recorded)."""
    host.log(2, message)


class Response:
    """An HTTP response with a status below 400 (a higher one raises Failed)."""

    def __init__(self, status, body):
        self.status = status
        self.body = body


class http:
    @staticmethod
    def get(url):
        """GET url. Keyed: a re-issue after a crash carries the same Idempotency-Key."""
        r = effect("http", {"method": "GET", "url": url})
        return Response(r["status"], r["body"])

    @staticmethod
    def post(url, body):
        """POST url with a JSON body. Keyed, as get."""
        r = effect("http", {"method": "POST", "url": url, "body": body})
        return Response(r["status"], r["body"])


class kv:
    @staticmethod
    def get(key):
        """The value stored under key in this plugin's namespace, or None."""
        return effect("kv.get", {"key": key})

    @staticmethod
    def put(key, value):
        """Stores value under key, exactly once however often the run dies."""
        effect("kv.put", {"key": key, "value": value})


class model:
    @staticmethod
    def chat(messages):
        """Asks the host's model ([{"role", "content"}, ...]); returns its answer,
        which also streams into the output."""
        return effect("model.chat", {"messages": messages})["content"]
