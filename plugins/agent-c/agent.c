// An example agent turn for leasehold, in C (wit-bindgen c + wasi-libc).
//
// One turn: ask the model, POST its answer to a tool, store the tool's reply
// in kv, optionally ask the user for more, and finish with a summary.
// Deterministic: the same calls with the same arguments in the same order
// given the same results, because the host replays recorded results on resume.
//
// Ownership (see the generated turn.c): `run`'s input string belongs to us
// and is freed here; the ok/err string we return must come from malloc (the
// generated cabi_post_run frees it); strings returned by imports (effect
// results, error payloads, wait-input's reply) belong to us and are freed
// here; arguments passed to imports are only borrowed by the host.
//
// Uses no stdio, clocks or randomness, so the core module imports nothing
// from WASI. Out of memory aborts (a trap), which the host classifies.
//
// The buffer, the JSON reader and writer and call_effect are in the typed
// helpers `leasehold new --lang c` ships (templates/c/leasehold.h).
//
// JSON: a strict RFC 8259 reader (rejects what Python's json and JS's
// JSON.parse reject) that pulls string fields out of a top-level object,
// the last duplicate winning, and a writer that escapes strings exactly as
// the Python and JS agents do (\" \\ \b \f \n \r \t, other control
// characters as lowercase \u00xx, everything else as raw UTF-8). A lone
// surrogate escape decodes to U+FFFD, as in the other two.

#include "leasehold.h"

bool exports_turn_run(turn_string_t *input, turn_string_t *ret, turn_string_t *err) {
  bool ok = false;
  buf_t prompt = {0}, tool_url = {0}, content = {0}, tool_body = {0}, req = {0}, msg = {0}, out = {0};
  turn_string_t chat = {0}, reply = {0}, put = {0};

  host_log(2, "agent: start");

  enum { PROMPT, TOOL_URL, ASK };
  field_t fields[] = {{"prompt", 0, NULL}, {"tool_url", 0, NULL}, {"ask", 0, NULL}};
  pos_t end = input->ptr + input->len;
  switch (read_object(input->ptr, end, fields, 3)) {
    case JSON_INVALID: *err = fail("bad input: not valid JSON"); goto out;
    case JSON_NOT_OBJECT: *err = fail("bad input: not a JSON object"); goto out;
  }
  if (fields[PROMPT].kind != FIELD_STRING) {
    *err = fail("bad input: \"prompt\" must be a string");
    goto out;
  }
  if (fields[TOOL_URL].kind != FIELD_STRING) {
    *err = fail("bad input: \"tool_url\" must be a string");
    goto out;
  }
  int ask_kind = fields[ASK].kind;
  if (ask_kind != FIELD_ABSENT && ask_kind != FIELD_NULL && ask_kind != FIELD_TRUE && ask_kind != FIELD_FALSE) {
    *err = fail("bad input: \"ask\" must be a boolean");
    goto out;
  }
  bool ask = ask_kind == FIELD_TRUE;
  field_string(&fields[PROMPT], end, &prompt);
  field_string(&fields[TOOL_URL], end, &tool_url);

  // 1. model.chat {"messages":[{"role":"user","content":<prompt>}]}
  buf_puts(&req, "{\"messages\":[{\"role\":\"user\",\"content\":");
  json_string(&req, prompt.ptr, prompt.len);
  buf_puts(&req, "}]}");
  if (!call_effect("model.chat", &req, &chat, err)) goto out;
  if (!string_member(chat, "content", &content)) {
    *err = fail("model.chat: result has no string \"content\"");
    goto out;
  }

  // 2. http {"method":"POST","url":<tool_url>,"body":<content>}
  req.len = 0;
  buf_puts(&req, "{\"method\":\"POST\",\"url\":");
  json_string(&req, tool_url.ptr, tool_url.len);
  buf_puts(&req, ",\"body\":");
  json_string(&req, content.ptr, content.len);
  buf_puts(&req, "}");
  if (!call_effect("http", &req, &reply, err)) goto out;
  if (!string_member(reply, "body", &tool_body)) {
    *err = fail("http: result has no string \"body\"");
    goto out;
  }

  // 3. kv.put {"key":"note","value":<tool body>}
  req.len = 0;
  buf_puts(&req, "{\"key\":\"note\",\"value\":");
  json_string(&req, tool_body.ptr, tool_body.len);
  buf_puts(&req, "}");
  if (!call_effect("kv.put", &req, &put, err)) goto out;

  // 4. {"message": content + "\ntool: " + body [+ "\nyou: " + reply]}
  buf_put(&msg, content.ptr, content.len);
  buf_puts(&msg, "\ntool: ");
  buf_put(&msg, tool_body.ptr, tool_body.len);
  if (ask) {
    turn_string_t question, answer;
    turn_string_set(&question, "Anything to add?");
    leasehold_turn_host_wait_input(&question, &answer);
    buf_puts(&msg, "\nyou: ");
    buf_put(&msg, answer.ptr, answer.len);
    turn_string_free(&answer);
  }
  buf_puts(&out, "{\"message\":");
  json_string(&out, msg.ptr, msg.len);
  buf_puts(&out, "}");
  *ret = buf_take(&out);
  ok = true;

out:
  turn_string_free(input);
  turn_string_free(&chat);
  turn_string_free(&reply);
  turn_string_free(&put);
  buf_free(&prompt);
  buf_free(&tool_url);
  buf_free(&content);
  buf_free(&tool_body);
  buf_free(&req);
  buf_free(&msg);
  buf_free(&out);
  return ok;
}
