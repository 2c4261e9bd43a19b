"""Typed helpers over leasehold's host functions: each effect takes and
returns Python values instead of JSON strings, and fails with an
EffectError subclass that says which effect failed and how. Every call is
recorded in the run's ledger and replayed when the run resumes, so make the
same calls in the same order every time (see wit/turn.wit).

Shipped with `leasehold new --lang python`.
"""

import json

from wit_world.imports import children as _children
from wit_world.imports import host
from wit_world.imports import waits as _waits
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


def _raise(name, e):
    error = e.value
    kind = {EffectError_Failed: Failed, EffectError_InDoubt: InDoubt, EffectError_Denied: Denied}.get(type(error), Failed)
    raise kind(name, getattr(error, "value", str(error))) from None


def _json(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def effect(name, request):
    """Performs effect `name` with a JSON-able request; returns its result."""
    try:
        result = host.effect(name, _json(request))
    except Err as e:
        _raise(name, e)
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


class children:
    """Child runs (docs/plugins.md, "Child runs"): spawn runs of other
    plugins (granted by the plugin's `spawn_allow`) and wait for them."""

    @staticmethod
    def spawn(plugin, input, options=None):
        """Spawns a run of `plugin` with the JSON-able `input` as a child of
        this run and returns its id. `options`: {"priority",
        "concurrency_key", "max_attempts", "detached"}."""
        try:
            return _children.spawn(plugin, _json(input), _json(options or {}))
        except Err as e:
            _raise("spawn", e)

    @staticmethod
    def await_all(ids, timeout_ms=None):
        """Waits for every child in `ids` to end (or `timeout_ms` to pass);
        returns their outcomes in order, each a dict: {"status":
        "completed", "output"}, {"status": "failed" | "aborted", "error"},
        {"status": "cancelled"} or {"status": "pending"}."""
        return children._wait(ids, _children.AwaitMode.ALL, timeout_ms)

    @staticmethod
    def await_any(ids, timeout_ms=None):
        """Waits for the first child in `ids` to end; the others are pending."""
        return children._wait(ids, _children.AwaitMode.ANY, timeout_ms)

    @staticmethod
    def _wait(ids, mode, timeout_ms):
        try:
            results = _children.await_children(list(ids), mode, timeout_ms)
        except Err as e:
            _raise("await-children", e)
        out = []
        for r in results:
            o = r.outcome
            if isinstance(o, _children.ChildOutcome_Completed):
                out.append({"status": "completed", "output": o.value})
            elif isinstance(o, _children.ChildOutcome_Failed):
                out.append({"status": "failed", "error": o.value})
            elif isinstance(o, _children.ChildOutcome_Aborted):
                out.append({"status": "aborted", "error": o.value})
            elif isinstance(o, _children.ChildOutcome_Cancelled):
                out.append({"status": "cancelled"})
            else:
                out.append({"status": "pending"})
        return out


class waits:
    """Named waits (docs/plugins.md, "Named waits"): input delivered to this
    run under a name, taken when the turn gets there."""

    @staticmethod
    def wait_for(name, prompt, timeout_ms=None):
        """Waits for input delivered under `name` (it may have arrived
        already) and returns it; None once `timeout_ms` has passed."""
        return _waits.wait_for(name, prompt, timeout_ms)

    @staticmethod
    def answer_link(name):
        """A one-use link that delivers input to the wait on `name` without
        the API token (POST <link> with {"input"})."""
        try:
            return _waits.answer_link(name)
        except Err as e:
            _raise("answer-link", e)
