// An example agent turn for leasehold, in JavaScript (componentize-js).
//
// One turn: ask the model, POST its answer to a tool, store the tool's reply
// in kv, optionally ask the user for more, and finish with a summary.
// Deterministic: the same calls with the same arguments in the same order
// given the same results, because the host replays recorded results on resume.
//
// componentize-js result mapping: returning a string completes `run` with
// `ok`; throwing a string fails it with `err`. An import returning
// `result<_, effect-error>` throws a ComponentError whose `payload` is the
// error variant, `{ tag: 'failed' | 'in-doubt' | 'denied', val: string }`.
//
// Requests are compact JSON with keys in a fixed order; JSON.stringify
// escapes strings exactly as the Python and C agents do.

// Effects go through the typed helpers `leasehold new --lang js` ships
// (templates/js/helpers.js); build.sh bundles them with this file.
import { EffectError, effect, log, waitInput } from './helpers.js';

const LONE_SURROGATE = /[\uD800-\uDBFF](?![\uDC00-\uDFFF])|(?<![\uD800-\uDBFF])[\uDC00-\uDFFF]/g;

// A lone surrogate (from a "\ud800" escape) cannot cross the component
// boundary; replace it with U+FFFD as the Python and C agents do.
function wellFormed(s) {
  return typeof s.toWellFormed === 'function' ? s.toWellFormed() : s.replace(LONE_SURROGATE, '\uFFFD');
}

function isObject(v) {
  return typeof v === 'object' && v !== null && !Array.isArray(v);
}

// Parses JSON text; returns { ok, value }.
function parse(text) {
  try {
    return { ok: true, value: JSON.parse(text) };
  } catch {
    return { ok: false, value: undefined };
  }
}

// The own string property `key` of the JSON object `text`, or null.
// The string `key` of the parsed JSON object `value`, or null.
function stringField(value, key) {
  if (!isObject(value) || !Object.prototype.hasOwnProperty.call(value, key)) return null;
  const field = value[key];
  return typeof field === 'string' ? wellFormed(field) : null;
}

// Calls effect `name`; throws "<name>: <message>" on failure.
function callEffect(name, request) {
  try {
    return effect(name, request);
  } catch (e) {
    throw e instanceof EffectError ? `${name}: ${e.detail}` : `${name}: ${String(e)}`;
  }
}

function field(args, key) {
  return Object.prototype.hasOwnProperty.call(args, key) ? args[key] : undefined;
}

export function run(input) {
  log('agent: start');

  const { ok, value: args } = parse(input);
  if (!ok) throw 'bad input: not valid JSON';
  if (!isObject(args)) throw 'bad input: not a JSON object';
  const prompt = field(args, 'prompt');
  if (typeof prompt !== 'string') throw 'bad input: "prompt" must be a string';
  const toolUrl = field(args, 'tool_url');
  if (typeof toolUrl !== 'string') throw 'bad input: "tool_url" must be a string';
  let ask = field(args, 'ask');
  if (ask === undefined || ask === null) ask = false;
  else if (typeof ask !== 'boolean') throw 'bad input: "ask" must be a boolean';

  const chat = callEffect('model.chat', { messages: [{ role: 'user', content: wellFormed(prompt) }] });
  const content = stringField(chat, 'content');
  if (content === null) throw 'model.chat: result has no string "content"';

  const reply = callEffect('http', { method: 'POST', url: wellFormed(toolUrl), body: content });
  const toolBody = stringField(reply, 'body');
  if (toolBody === null) throw 'http: result has no string "body"';

  callEffect('kv.put', { key: 'note', value: toolBody });

  let message = `${content}\ntool: ${toolBody}`;
  if (ask) message += `\nyou: ${waitInput('Anything to add?')}`;
  return JSON.stringify({ message });
}
