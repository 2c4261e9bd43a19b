"""{{name}}: a leasehold turn. Input: {"url": "http://..."}. It fetches the
URL (http), counts its visits in kv, streams a line (emit) and returns a
summary. Every effect goes through the typed helpers in helpers.py; each is
recorded, and replayed when the run resumes, so the turn must make the same
calls in the same order every time. An uncaught exception fails the run with
its traceback in the run's error."""

import json

import wit_world
from componentize_py_types import Err
from helpers import EffectError, emit, http, kv


def turn(data):
    url = data["url"]
    page = http.get(url)
    visits = (kv.get("visits") or 0) + 1
    kv.put("visits", visits)
    emit(f"fetched {url}\n")
    return f"fetched {len(page.body.encode())} bytes (HTTP {page.status}); visit {visits}"


class WitWorld(wit_world.WitWorld):
    def run(self, input: str) -> str:
        try:
            return turn(json.loads(input))
        except EffectError as e:
            # A failed effect ends the run with its message; any other
            # exception traps, and the run's error shows its traceback.
            raise Err(str(e))
