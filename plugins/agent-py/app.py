"""An example agent turn for leasehold, in Python (componentize-py).

One turn: ask the model, POST its answer to a tool, store the tool's reply in
kv, optionally ask the user for more, and finish with a summary. With
"delegate", it first hands that sub-question to a child run of itself
(leasehold:turn@0.2.0's child runs; the plugin needs agent-py on its
spawn_allow list) and adds the child's answer to its own. Deterministic:
the same calls with the same arguments in the same order given the same
results, because the host replays recorded results on resume.

Effects go through the typed helpers `leasehold new --lang python` ships.
Requests are compact JSON with keys in a fixed order, and strings escaped
exactly as the JS and C agents escape them (\\" \\\\ \\b \\f \\n \\r \\t, other
control characters as lowercase \\u00xx, everything else as raw UTF-8).
"""

import json
import re

import wit_world
from wit_world.imports import host
from componentize_py_types import Err

# The typed helpers `leasehold new --lang python` ships
# (templates/python/helpers.py): effect() raises EffectError("<name>: <message>").
from helpers import EffectError, children, effect


def _reject_constant(name):
    # json.loads accepts NaN/Infinity by default; JSON does not.
    raise ValueError("not JSON: " + name)


_SURROGATE = re.compile("[\ud800-\udfff]")


def _well_formed(s):
    # A lone surrogate (from a "\ud800" escape) cannot cross the component
    # boundary; replace it with U+FFFD as the JS and C agents do. (json.loads
    # joins escaped surrogate pairs, so any surrogate left is a lone one.
    # No codecs here: the componentized stdlib lacks e.g. utf-16.)
    return _SURROGATE.sub("\ufffd", s)


def _parse(text):
    """Parses JSON text; returns (ok, value)."""
    try:
        return True, json.loads(text, parse_constant=_reject_constant)
    except Exception:  # ValueError, RecursionError
        return False, None


def _dumps(value):
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _string(value, key):
    """The string `key` of the JSON object `value` (parsed), or None."""
    field = value.get(key) if isinstance(value, dict) else None
    return _well_formed(field) if isinstance(field, str) else None


class WitWorld(wit_world.WitWorld):
    def run(self, input: str) -> str:
        try:
            return _turn(input)
        except EffectError as e:
            raise Err(str(e))


def _turn(input):
    """The turn; a failed effect raises EffectError."""
    host.log(2, "agent: start")

    ok, args = _parse(input)
    if not ok:
        raise Err("bad input: not valid JSON")
    if not isinstance(args, dict):
        raise Err("bad input: not a JSON object")
    prompt = args.get("prompt")
    if not isinstance(prompt, str):
        raise Err('bad input: "prompt" must be a string')
    tool_url = args.get("tool_url")
    if not isinstance(tool_url, str):
        raise Err('bad input: "tool_url" must be a string')
    ask = args.get("ask")
    if ask is None:
        ask = False
    elif not isinstance(ask, bool):
        raise Err('bad input: "ask" must be a boolean')
    delegate = args.get("delegate")
    if delegate is not None and not isinstance(delegate, str):
        raise Err('bad input: "delegate" must be a string')
    prompt = _well_formed(prompt)
    tool_url = _well_formed(tool_url)

    helper = None
    if delegate:
        # A child agent answers the sub-question; waiting for it holds no
        # worker. Its answer (or how it ended) joins this turn's message.
        child = children.spawn("agent-py", {"prompt": _well_formed(delegate), "tool_url": tool_url})
        [outcome] = children.await_all([child], 600_000)
        if outcome["status"] == "completed":
            ok, answer = _parse(outcome["output"])
            helper = _string(answer, "message") if ok else None
        if helper is None:
            helper = "(the helper run " + outcome["status"] + ")"

    chat = effect("model.chat", {"messages": [{"role": "user", "content": prompt}]})
    content = _string(chat, "content")
    if content is None:
        raise Err('model.chat: result has no string "content"')

    reply = effect("http", {"method": "POST", "url": tool_url, "body": content})
    tool_body = _string(reply, "body")
    if tool_body is None:
        raise Err('http: result has no string "body"')

    effect("kv.put", {"key": "note", "value": tool_body})

    message = content + "\ntool: " + tool_body
    if helper is not None:
        message += "\nhelper: " + helper
    if ask:
        message += "\nyou: " + host.wait_input("Anything to add?")
    return _dumps({"message": message})
