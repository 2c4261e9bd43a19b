// Typed helpers over leasehold's host functions, for a C turn (wit-bindgen c
// + wasi-libc), shipped with `leasehold new --lang c`. Include it once, in
// the file that defines exports_turn_run.
//
// Each effect below returns true on success; on failure it sets *err to
// "<effect>: <message>", a malloc'd string to return as run's error (the
// generated code frees it) or to free with turn_string_free. Every call is
// recorded in the run's ledger and replayed when the run resumes, so make
// the same calls in the same order every time (see wit/turn.wit).
//
// Below the typed effects: a growable buffer (buf_t), a JSON string writer
// (json_string) and a strict JSON reader (read_object, string_member), as
// the example agent plugins/agent-c uses them. Out of memory aborts (a
// trap, which the host reports).

#ifndef LEASEHOLD_HELPERS_H
#define LEASEHOLD_HELPERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "turn.h"

// ---------------------------------------------------------------------------
// A growable byte buffer. Allocation failure aborts.

typedef struct {
  uint8_t *ptr;
  size_t len, cap;
} buf_t;

static inline void buf_reserve(buf_t *b, size_t extra) {
  if (extra <= b->cap - b->len) return;
  if (extra > SIZE_MAX / 2 - b->len) abort();
  size_t cap = b->cap ? b->cap : 64;
  while (cap - b->len < extra) cap *= 2;
  uint8_t *p = realloc(b->ptr, cap);
  if (!p) abort();
  b->ptr = p;
  b->cap = cap;
}

static inline void buf_put(buf_t *b, const void *s, size_t n) {
  if (n == 0) return;
  buf_reserve(b, n);
  memcpy(b->ptr + b->len, s, n);
  b->len += n;
}

static inline void buf_puts(buf_t *b, const char *s) { buf_put(b, s, strlen(s)); }

static inline void buf_byte(buf_t *b, uint8_t c) { buf_put(b, &c, 1); }

static inline void buf_free(buf_t *b) {
  free(b->ptr);
  b->ptr = NULL;
  b->len = b->cap = 0;
}

// Hands the buffer's bytes over as a string the generated code may free.
static inline turn_string_t buf_take(buf_t *b) {
  turn_string_t s = {b->ptr, b->len};
  if (b->len == 0) {  // cabi_post_run frees only non-empty strings
    free(b->ptr);
    s.ptr = NULL;
  }
  b->ptr = NULL;
  b->len = b->cap = 0;
  return s;
}

static inline void buf_utf8(buf_t *b, uint32_t cp) {
  uint8_t u[4];
  size_t n;
  if (cp < 0x80) {
    u[0] = (uint8_t)cp;
    n = 1;
  } else if (cp < 0x800) {
    u[0] = (uint8_t)(0xC0 | (cp >> 6));
    u[1] = (uint8_t)(0x80 | (cp & 0x3F));
    n = 2;
  } else if (cp < 0x10000) {
    u[0] = (uint8_t)(0xE0 | (cp >> 12));
    u[1] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    u[2] = (uint8_t)(0x80 | (cp & 0x3F));
    n = 3;
  } else {
    u[0] = (uint8_t)(0xF0 | (cp >> 18));
    u[1] = (uint8_t)(0x80 | ((cp >> 12) & 0x3F));
    u[2] = (uint8_t)(0x80 | ((cp >> 6) & 0x3F));
    u[3] = (uint8_t)(0x80 | (cp & 0x3F));
    n = 4;
  }
  buf_put(b, u, n);
}

// ---------------------------------------------------------------------------
// JSON writer

// Appends `s` as a JSON string literal (with quotes).
static inline void json_string(buf_t *b, const uint8_t *s, size_t n) {
  static const char hex[] = "0123456789abcdef";
  buf_byte(b, '"');
  size_t run = 0;  // start of the pending stretch that needs no escaping
  for (size_t i = 0; i < n; i++) {
    uint8_t c = s[i];
    const char *esc = NULL;
    char u[7];
    switch (c) {
      case '"': esc = "\\\""; break;
      case '\\': esc = "\\\\"; break;
      case '\b': esc = "\\b"; break;
      case '\f': esc = "\\f"; break;
      case '\n': esc = "\\n"; break;
      case '\r': esc = "\\r"; break;
      case '\t': esc = "\\t"; break;
      default:
        if (c < 0x20) {
          memcpy(u, "\\u00", 4);
          u[4] = hex[c >> 4];
          u[5] = hex[c & 15];
          u[6] = 0;
          esc = u;
        }
    }
    if (esc) {
      if (i > run) buf_put(b, s + run, i - run);
      buf_puts(b, esc);
      run = i + 1;
    }
  }
  if (n > run) buf_put(b, s + run, n - run);
  buf_byte(b, '"');
}

// ---------------------------------------------------------------------------
// JSON reader. Every function takes the current position and the end of the
// text and returns the position after what it read, or NULL if the text is
// not JSON there.

typedef const uint8_t *pos_t;

static inline pos_t skip_ws(pos_t p, pos_t e) {
  while (p < e && (*p == ' ' || *p == '\t' || *p == '\n' || *p == '\r')) p++;
  return p;
}

static inline int hex_val(uint8_t c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  if (c >= 'A' && c <= 'F') return c - 'A' + 10;
  return -1;
}

// Reads the 4 hex digits of a \u escape at p.
static inline bool hex4(pos_t p, pos_t e, uint32_t *out) {
  if (e - p < 4) return false;
  uint32_t v = 0;
  for (int i = 0; i < 4; i++) {
    int h = hex_val(p[i]);
    if (h < 0) return false;
    v = v << 4 | (uint32_t)h;
  }
  *out = v;
  return true;
}

// Reads a string literal at p (which must be at its opening quote). Appends
// its decoded UTF-8 to `out` unless `out` is NULL. The text itself is valid
// UTF-8 (a component-model string), so bytes >= 0x80 pass through as is.
static inline pos_t read_string(pos_t p, pos_t e, buf_t *out) {
  if (p >= e || *p != '"') return NULL;
  p++;
  pos_t run = p;
  for (;;) {
    if (p >= e) return NULL;
    uint8_t c = *p;
    if (c == '"') {
      if (out) buf_put(out, run, (size_t)(p - run));
      return p + 1;
    }
    if (c < 0x20) return NULL;
    if (c != '\\') {
      p++;
      continue;
    }
    if (out) buf_put(out, run, (size_t)(p - run));
    if (e - p < 2) return NULL;
    uint8_t x = p[1];
    p += 2;
    uint32_t cp;
    switch (x) {
      case '"': cp = '"'; break;
      case '\\': cp = '\\'; break;
      case '/': cp = '/'; break;
      case 'b': cp = '\b'; break;
      case 'f': cp = '\f'; break;
      case 'n': cp = '\n'; break;
      case 'r': cp = '\r'; break;
      case 't': cp = '\t'; break;
      case 'u':
        if (!hex4(p, e, &cp)) return NULL;
        p += 4;
        if (cp >= 0xD800 && cp <= 0xDBFF) {
          uint32_t lo;
          if (e - p >= 6 && p[0] == '\\' && p[1] == 'u' && hex4(p + 2, e, &lo) && lo >= 0xDC00 &&
              lo <= 0xDFFF) {
            cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
            p += 6;
          } else {
            cp = 0xFFFD;  // a lone high surrogate
          }
        } else if (cp >= 0xDC00 && cp <= 0xDFFF) {
          cp = 0xFFFD;  // a lone low surrogate
        }
        break;
      default:
        return NULL;
    }
    if (out) buf_utf8(out, cp);
    run = p;
  }
}

static inline pos_t read_digits(pos_t p, pos_t e) {
  if (p >= e || *p < '0' || *p > '9') return NULL;
  while (p < e && *p >= '0' && *p <= '9') p++;
  return p;
}

// -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?
static inline pos_t read_number(pos_t p, pos_t e) {
  if (p < e && *p == '-') p++;
  if (p < e && *p == '0') {
    p++;
  } else if (!(p = read_digits(p, e))) {
    return NULL;
  }
  if (p < e && *p == '.' && !(p = read_digits(p + 1, e))) return NULL;
  if (p < e && (*p == 'e' || *p == 'E')) {
    p++;
    if (p < e && (*p == '+' || *p == '-')) p++;
    if (!(p = read_digits(p, e))) return NULL;
  }
  return p;
}

static inline pos_t read_literal(pos_t p, pos_t e, const char *word) {
  size_t n = strlen(word);
  if ((size_t)(e - p) < n || memcmp(p, word, n) != 0) return NULL;
  return p + n;
}

// Reads a string, number, true, false or null at p.
static inline pos_t read_scalar(pos_t p, pos_t e) {
  if (p >= e) return NULL;
  switch (*p) {
    case '"': return read_string(p, e, NULL);
    case 't': return read_literal(p, e, "true");
    case 'f': return read_literal(p, e, "false");
    case 'n': return read_literal(p, e, "null");
    default: return read_number(p, e);
  }
}

// Reads `"key" :` (with whitespace) at p, the key decoded into `key` unless
// it is NULL.
static inline pos_t read_key(pos_t p, pos_t e, buf_t *key) {
  p = read_string(skip_ws(p, e), e, key);
  if (!p) return NULL;
  p = skip_ws(p, e);
  if (p >= e || *p != ':') return NULL;
  return p + 1;
}

// Reads any JSON value at p (leading whitespace allowed). Iterative, with
// the open containers on a heap stack, so nesting depth is bounded only by
// memory.
static inline pos_t read_value(pos_t p, pos_t e) {
  buf_t stack = {0};  // one byte per open container: '{' or '['
  pos_t result = NULL;
  for (;;) {
    // A value starts here.
    p = skip_ws(p, e);
    if (p >= e) goto done;
    if (*p == '{' || *p == '[') {
      uint8_t open = *p;
      buf_byte(&stack, open);
      p = skip_ws(p + 1, e);
      if (p < e && *p == (open == '{' ? '}' : ']')) {
        p++;
        stack.len--;
      } else {
        if (open == '{' && !(p = read_key(p, e, NULL))) goto done;
        continue;  // the first element
      }
    } else if (!(p = read_scalar(p, e))) {
      goto done;
    }
    // A value ended: close containers until one has a next element.
    for (;;) {
      if (stack.len == 0) {
        result = p;
        goto done;
      }
      uint8_t open = stack.ptr[stack.len - 1];
      p = skip_ws(p, e);
      if (p >= e) goto done;
      if (*p == ',') {
        p++;
        if (open == '{' && !(p = read_key(p, e, NULL))) goto done;
        break;
      }
      if (*p != (open == '{' ? '}' : ']')) goto done;
      p++;
      stack.len--;
    }
  }
done:
  buf_free(&stack);
  return result;
}

enum { FIELD_ABSENT = 0, FIELD_STRING, FIELD_TRUE, FIELD_FALSE, FIELD_NULL, FIELD_OTHER };

typedef struct {
  const char *name;  // in
  int kind;          // out: FIELD_*
  pos_t start;       // out: where its value starts (FIELD_STRING: the quote)
} field_t;

enum { JSON_INVALID = -1, JSON_NOT_OBJECT = 0, JSON_OBJECT = 1 };

// Parses the JSON text [p, e); if it is an object, finds the top-level
// members named in `fields` (the last of duplicates wins).
static inline int read_object(pos_t p, pos_t e, field_t *fields, size_t nfields) {
  for (size_t i = 0; i < nfields; i++) fields[i].kind = FIELD_ABSENT;
  p = skip_ws(p, e);
  if (p >= e || *p != '{') {
    p = read_value(p, e);
    return p && skip_ws(p, e) == e ? JSON_NOT_OBJECT : JSON_INVALID;
  }
  p = skip_ws(p + 1, e);
  if (p < e && *p == '}') return skip_ws(p + 1, e) == e ? JSON_OBJECT : JSON_INVALID;
  buf_t key = {0};
  int result = JSON_INVALID;
  for (;;) {
    key.len = 0;
    if (!(p = read_key(p, e, &key))) break;
    pos_t value = skip_ws(p, e);
    if (!(p = read_value(value, e))) break;
    for (size_t i = 0; i < nfields; i++) {
      if (key.len != strlen(fields[i].name) || memcmp(key.ptr, fields[i].name, key.len) != 0) continue;
      fields[i].start = value;
      switch (*value) {
        case '"': fields[i].kind = FIELD_STRING; break;
        case 't': fields[i].kind = FIELD_TRUE; break;
        case 'f': fields[i].kind = FIELD_FALSE; break;
        case 'n': fields[i].kind = FIELD_NULL; break;
        default: fields[i].kind = FIELD_OTHER; break;
      }
    }
    p = skip_ws(p, e);
    if (p < e && *p == ',') {
      p++;
      continue;
    }
    if (p < e && *p == '}' && skip_ws(p + 1, e) == e) result = JSON_OBJECT;
    break;
  }
  buf_free(&key);
  return result;
}

// Decodes the string value of a field found by read_object into `out`.
static inline void field_string(const field_t *f, pos_t e, buf_t *out) {
  out->len = 0;
  read_string(f->start, e, out);  // already validated
}

// Reads the string member `name` of the JSON object `text` into `out`.
static inline bool string_member(turn_string_t text, const char *name, buf_t *out) {
  pos_t e = text.ptr + text.len;
  field_t f = {name, 0, NULL};
  if (read_object(text.ptr, e, &f, 1) != JSON_OBJECT || f.kind != FIELD_STRING) return false;
  field_string(&f, e, out);
  return true;
}

// ---------------------------------------------------------------------------
// Calling effects

static inline turn_string_t str_of(const buf_t *b) { return (turn_string_t){b->ptr, b->len}; }

// A malloc'd copy of `prefix` + `s`, for returning as `run`'s error.
static inline turn_string_t message(const char *prefix, const uint8_t *s, size_t n) {
  buf_t b = {0};
  buf_puts(&b, prefix);
  buf_put(&b, s, n);
  return buf_take(&b);
}

static inline turn_string_t fail(const char *text) { return message(text, NULL, 0); }

// Calls effect `name` with `request`. On success stores the result (ours to
// free) in `*result`; on failure stores "<name>: <message>" in `*err`.
static inline bool call_effect(const char *name, const buf_t *request, turn_string_t *result, turn_string_t *err) {
  turn_string_t n, req = str_of(request);
  turn_string_set(&n, name);
  leasehold_turn_host_effect_error_t e;
  if (leasehold_turn_host_effect(&n, &req, result, &e)) return true;
  const turn_string_t *payload = e.tag == LEASEHOLD_TURN_HOST_EFFECT_ERROR_FAILED     ? &e.val.failed
                                 : e.tag == LEASEHOLD_TURN_HOST_EFFECT_ERROR_IN_DOUBT ? &e.val.in_doubt
                                                                                       : &e.val.denied;
  buf_t b = {0};
  buf_puts(&b, name);
  buf_puts(&b, ": ");
  buf_put(&b, payload->ptr, payload->len);
  *err = buf_take(&b);
  leasehold_turn_host_effect_error_free(&e);
  return false;
}

static inline void host_log(uint8_t level, const char *text) {
  turn_string_t s;
  turn_string_set(&s, text);
  leasehold_turn_host_log(level, &s);
}


static inline void host_emit(const char *text) {
  turn_string_t s;
  turn_string_set(&s, text);
  leasehold_turn_host_emit(&s);
}

// ---------------------------------------------------------------------------
// Typed effects

// An HTTP response with a status below 400 (a higher one is a failure).
typedef struct {
  long status;
  buf_t body;  // free with buf_free
} lh_response_t;

// Appends {"key":<key>} without its closing brace.
static inline void lh_key_request(buf_t *req, const char *key) {
  buf_puts(req, "{\"key\":");
  json_string(req, (const uint8_t *)key, strlen(key));
}

// GET url. Keyed: a re-issue after a crash carries the same Idempotency-Key.
static inline bool lh_http_get(const char *url, lh_response_t *resp, turn_string_t *err) {
  buf_t req = {0};
  buf_puts(&req, "{\"method\":\"GET\",\"url\":");
  json_string(&req, (const uint8_t *)url, strlen(url));
  buf_byte(&req, '}');
  turn_string_t result;
  bool ok = call_effect("http", &req, &result, err);
  buf_free(&req);
  if (!ok) return false;
  pos_t e = result.ptr + result.len;
  field_t f[2] = {{"status", 0, NULL}, {"body", 0, NULL}};
  ok = read_object(result.ptr, e, f, 2) == JSON_OBJECT && f[0].kind == FIELD_OTHER && f[1].kind == FIELD_STRING;
  if (ok) {
    resp->status = strtol((const char *)f[0].start, NULL, 10);  // ends at the ',' or '}' after it
    resp->body = (buf_t){0};
    field_string(&f[1], e, &resp->body);
  } else {
    *err = fail("http: unexpected result");
  }
  turn_string_free(&result);
  return ok;
}

// kv.get of an integer: *found is false when the key holds nothing.
static inline bool lh_kv_get_int(const char *key, long *value, bool *found, turn_string_t *err) {
  buf_t req = {0};
  lh_key_request(&req, key);
  buf_byte(&req, '}');
  turn_string_t result;
  bool ok = call_effect("kv.get", &req, &result, err);
  buf_free(&req);
  if (!ok) return false;
  *found = !(result.len == 4 && memcmp(result.ptr, "null", 4) == 0);
  if (*found) {
    buf_t text = {0};
    buf_put(&text, result.ptr, result.len);
    buf_byte(&text, 0);
    *value = strtol((const char *)text.ptr, NULL, 10);
    buf_free(&text);
  }
  turn_string_free(&result);
  return true;
}

// kv.put of an integer, exactly once however often the run dies.
static inline bool lh_kv_put_int(const char *key, long value, turn_string_t *err) {
  buf_t req = {0};
  // The digits of value, without stdio (which would import WASI).
  char digits[24];
  size_t n = sizeof digits;
  unsigned long u = value < 0 ? 0UL - (unsigned long)value : (unsigned long)value;
  do {
    digits[--n] = (char)('0' + u % 10);
    u /= 10;
  } while (u);
  if (value < 0) digits[--n] = '-';
  lh_key_request(&req, key);
  buf_puts(&req, ",\"value\":");
  buf_put(&req, digits + n, sizeof digits - n);
  buf_byte(&req, '}');
  turn_string_t result;
  bool ok = call_effect("kv.put", &req, &result, err);
  buf_free(&req);
  if (ok) turn_string_free(&result);
  return ok;
}

// ---------------------------------------------------------------------------
// Child runs (docs/plugins.md, "Child runs"): spawn runs of other plugins
// (granted by the plugin's spawn_allow) and wait for them.

// Stores "<name>: <message>" for a children call's error in *err.
static inline void lh_children_error(const char *name, leasehold_turn_children_effect_error_t *e, turn_string_t *err) {
  const turn_string_t *payload = e->tag == LEASEHOLD_TURN_HOST_EFFECT_ERROR_FAILED     ? &e->val.failed
                                 : e->tag == LEASEHOLD_TURN_HOST_EFFECT_ERROR_IN_DOUBT ? &e->val.in_doubt
                                                                                        : &e->val.denied;
  buf_t b = {0};
  buf_puts(&b, name);
  buf_puts(&b, ": ");
  buf_put(&b, payload->ptr, payload->len);
  *err = buf_take(&b);
  leasehold_turn_children_effect_error_free(e);
}

// Spawns a run of `plugin` with the JSON `input` as a child of this run;
// `options` is a JSON object ("{}" for none). Stores its id in *id.
static inline bool lh_spawn(const char *plugin, const buf_t *input, const char *options, uint64_t *id, turn_string_t *err) {
  turn_string_t p, in = str_of(input), o;
  turn_string_set(&p, plugin);
  turn_string_set(&o, options);
  leasehold_turn_children_effect_error_t e;
  if (leasehold_turn_children_spawn(&p, &in, &o, id, &e)) return true;
  lh_children_error("spawn", &e, err);
  return false;
}

// Waits for every child in ids[0..n) to end (any: the first), or for
// timeout_ms if it is not NULL. On success *results holds each child's
// outcome in order (tag LEASEHOLD_TURN_CHILDREN_CHILD_OUTCOME_*; free with
// leasehold_turn_children_list_child_result_free).
static inline bool lh_await_children(uint64_t *ids, size_t n, bool any, uint64_t *timeout_ms,
                                     leasehold_turn_children_list_child_result_t *results, turn_string_t *err) {
  turn_list_u64_t list = {ids, n};
  leasehold_turn_children_effect_error_t e;
  leasehold_turn_children_await_mode_t mode = any ? LEASEHOLD_TURN_CHILDREN_AWAIT_MODE_ANY : LEASEHOLD_TURN_CHILDREN_AWAIT_MODE_ALL;
  if (leasehold_turn_children_await_children(&list, mode, timeout_ms, results, &e)) return true;
  lh_children_error("await-children", &e, err);
  return false;
}

// ---------------------------------------------------------------------------
// Named waits (docs/plugins.md, "Named waits"): input delivered to this run
// under a name, taken when the turn gets there.

// Waits for input delivered under `name` (it may have arrived already).
// True with the input in *input (free with turn_string_free); false once
// *timeout_ms (if not NULL) has passed.
static inline bool lh_wait_for(const char *name, const char *prompt, uint64_t *timeout_ms, turn_string_t *input) {
  turn_string_t n, p;
  turn_string_set(&n, name);
  turn_string_set(&p, prompt);
  return leasehold_turn_waits_wait_for(&n, &p, timeout_ms, input);
}

// A one-use link that delivers input to the wait on `name` without the API
// token (POST <link> with {"input"}), in *link (free with turn_string_free).
static inline bool lh_answer_link(const char *name, turn_string_t *link, turn_string_t *err) {
  turn_string_t n;
  turn_string_set(&n, name);
  leasehold_turn_waits_effect_error_t e;
  if (leasehold_turn_waits_answer_link(&n, link, &e)) return true;
  lh_children_error("answer-link", &e, err);
  return false;
}

#endif
