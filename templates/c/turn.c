// {{name}}: a leasehold turn. Input: {"url": "http://..."}. It fetches the
// URL (http), counts its visits in kv, streams a line (emit) and returns a
// summary. Every effect goes through the typed helpers in leasehold.h; each
// is recorded, and replayed when the run resumes, so the turn must make the
// same calls in the same order every time.
//
// Ownership (see the generated turn.c): `input` is ours to free; the ok and
// err strings returned must come from malloc (the generated code frees them).

#include "leasehold.h"

bool exports_turn_run(turn_string_t *input, turn_string_t *ret, turn_string_t *err) {
  bool ok = false;
  buf_t url = {0}, out = {0};
  lh_response_t page = {0};
  if (!string_member(*input, "url", &url)) {
    *err = fail("bad input: \"url\" must be a string");
    goto done;
  }
  buf_byte(&url, 0);  // a C string for the helpers
  if (!lh_http_get((const char *)url.ptr, &page, err)) goto done;
  long visits = 0;
  bool found = false;
  if (!lh_kv_get_int("visits", &visits, &found, err)) goto done;
  visits += 1;
  if (!lh_kv_put_int("visits", visits, err)) goto done;

  buf_puts(&out, "fetched ");
  buf_puts(&out, (const char *)url.ptr);
  buf_puts(&out, "\n");
  buf_byte(&out, 0);
  host_emit((const char *)out.ptr);

  // "fetched <n> bytes (HTTP <status>); visit <visits>"
  long numbers[3] = {(long)page.body.len, page.status, visits};
  const char *parts[4] = {"fetched ", " bytes (HTTP ", "); visit ", ""};
  out.len = 0;
  for (int i = 0; i < 3; i++) {
    buf_puts(&out, parts[i]);
    char digits[24];
    size_t n = sizeof digits;
    unsigned long u = (unsigned long)numbers[i];
    do {
      digits[--n] = (char)('0' + u % 10);
      u /= 10;
    } while (u);
    buf_put(&out, digits + n, sizeof digits - n);
  }
  *ret = buf_take(&out);
  ok = true;
done:
  buf_free(&url);
  buf_free(&out);
  buf_free(&page.body);
  turn_string_free(input);
  return ok;
}
