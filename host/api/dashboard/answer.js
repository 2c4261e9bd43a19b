// The page of an answer link (GET /v1/answers/{token}): opening it changes
// nothing (mail scanners open links); sending the form POSTs the answer as
// JSON to the same address, which delivers it once.

const form = document.getElementById('answer-form');
const input = document.getElementById('answer-input');
const result = document.getElementById('answer-result');

form.addEventListener('submit', async (e) => {
  e.preventDefault();
  const send = document.getElementById('answer-send');
  send.disabled = true;
  let text;
  try {
    const res = await fetch(location.pathname, {
      method: 'POST',
      headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ input: input.value }),
    });
    const body = await res.json().catch(() => ({}));
    if (res.ok) {
      text = 'Sent. Thank you.';
      form.hidden = true;
    } else {
      text = body?.error?.message || `The answer was refused (${res.status}).`;
      send.disabled = res.status === 410;
      if (res.status === 410) form.hidden = true;
    }
  } catch (err) {
    text = `Could not send: ${err.message}`;
    send.disabled = false;
  }
  result.textContent = text;
  result.hidden = false;
  document.body.dataset.answered = '1';
});
document.body.dataset.ready = '1';
