//! The test plugin. The input's `mode` picks the behaviour:
//!
//! * `steps` (default): `steps` times, burns `spin` iterations (default 0),
//!   `kv.put` key `<prefix>-<i>` then emits `"step <i> "`; returns
//!   `"did <n> steps"`. Deterministic, one effect per step: for crash,
//!   replay and bench tests. Built with feature `v2` (`testkit-v2.wasm`),
//!   step 1's key is `<prefix>-1-v2`: a new version whose second call
//!   differs.
//! * `wait`: asks for input, returns `"hello <input>"`.
//! * `sleep`: sleeps `ms`, returns `"woke"`.
//! * `spin-then-put`: burns CPU for `spins` iterations, then `kv.put`.
//! * `http`: burns `spin_before` iterations, POSTs to `url` with `http` (or
//!   `http.unkeyed` when `keyed` is false), burns `spin_after`, and returns
//!   the result, or `"in-doubt: …"` when the host reports it in doubt
//!   (with `fail_in_doubt`, the run fails instead).
//! * `http-steps`: `steps` times, POSTs `{"step": i}` to `url` with `http`
//!   then emits `"step <i> "`; returns `"did <n> http steps"`.
//! * `chaos`: `steps` times: burns `spin` iterations, increments the
//!   counter `count-<tag>` (`kv.get` then `kv.put`, local), POSTs
//!   `{"tag", "step", "kind": "keyed"}` to `url` with `http` and the same
//!   with `"kind": "unkeyed"` with `http.unkeyed`, both carrying the
//!   input's `delay_ms` for the sink to wait (an in-doubt answer is
//!   counted, not retried), then emits `"step <i> "`; burns `spin` again
//!   and returns `"did <n> chaos steps, <k> in doubt"`. For the
//!   fault-injection suite, which checks each effect at its sink.
//! * `calls`: makes `n` `log` calls at trace level (host-call overhead).
//! * `emit-then-spin`: emits `"early "`, burns `spins` iterations, emits
//!   `"late"` and returns `"spun"` (a delta must reach the stream while
//!   the turn still computes).
//! * `put-then-spin`: `kv.put` key `early`, burns `spins` iterations and
//!   returns `"spun"` (a put must reach the database while the turn still
//!   computes).
//! * `script`: runs `ops` in order and returns the JSON list of what each
//!   gave: `{"op": "put", "key"}` (`kv.put`), `{"op": "emit", "text"}`,
//!   `{"op": "sleep", "ms"}` (the host's durable timer),
//!   `{"op": "wasi-sleep", "ms"}` (the language's own sleep:
//!   `std::thread::sleep`), `{"op": "chat", "prompt"}` (`model.chat`; a
//!   failure is returned, not raised), `{"op": "http", "url", "keyed"}`,
//!   `{"op": "random", "bytes"}` (WASI secure random, as hex),
//!   `{"op": "put-random", "key"}` (puts 16 random bytes, as hex: a replay
//!   that drew other bytes would make another request),
//!   `{"op": "clock"}` (WASI monotonic and wall clocks, in ms),
//!   `{"op": "wait", "prompt"}` and `{"op": "effect", "name", "request"}`.
//! * hostile: `loop` (never returns), `oom` (allocates without bound),
//!   `emit-bomb` (emits 1 MiB chunks forever), `trap` (unreachable),
//!   `big-output` (returns 2 MiB), `fail` (returns an error), `nul` (emits,
//!   puts a key, calls an effect and returns text, each holding a NUL),
//!   `nul-fail` (returns an error holding a NUL), `big-name` (an effect
//!   whose name is 8 MiB), `long-name` (300 bytes), `bad-name`,
//!   `big-prompt` (a 1 MiB `wait-input` prompt), `log-flood` (`n` log
//!   lines with control characters), `random-bomb` (asks WASI for 1 GiB of
//!   random), `table-bomb` (keeps WASI pollables without bound),
//!   `kv-big` (puts a `bytes`-long value), `gets` (`n` `kv.get`s),
//!   `panic` (panics with `message`), `print` (`lines` lines on stdout and
//!   on stderr, then returns `"printed"`).

wit_bindgen::generate!({ path: "../../wit/0.1.0", world: "turn" });

use leasehold::turn::host::{EffectError, effect, emit, sleep, wait_input};
use serde_json::Value;

struct Testkit;

fn describe(e: EffectError) -> String {
    match e {
        EffectError::Failed(m) => format!("failed: {m}"),
        EffectError::InDoubt(m) => format!("in-doubt: {m}"),
        EffectError::Denied(m) => format!("denied: {m}"),
    }
}

impl Guest for Testkit {
    fn run(input: String) -> Result<String, String> {
        let v: Value = serde_json::from_str(&input).map_err(|e| format!("bad input: {e}"))?;
        match v["mode"].as_str().unwrap_or("steps") {
            "steps" => {
                let n = v["steps"].as_u64().unwrap_or(3);
                let prefix = v["prefix"].as_str().unwrap_or("step");
                let work = v["spin"].as_u64().unwrap_or(0);
                for i in 0..n {
                    spin(work);
                    // The `v2` build is "a new version" that makes a
                    // different second call, for replay and upgrade tests.
                    let key = if cfg!(feature = "v2") && i == 1 { format!("{prefix}-{i}-v2") } else { format!("{prefix}-{i}") };
                    let request = serde_json::json!({ "key": key, "value": i });
                    effect("kv.put", &request.to_string()).map_err(describe)?;
                    emit(&format!("step {i} "));
                }
                Ok(format!("did {n} steps"))
            }
            "chaos" => {
                let n = v["steps"].as_u64().unwrap_or(3);
                let spins = v["spin"].as_u64().unwrap_or(0);
                let tag = v["tag"].as_str().unwrap_or("untagged");
                let counter = format!("count-{tag}");
                let mut in_doubt = 0;
                for i in 0..n {
                    spin(spins);
                    let got = effect("kv.get", &serde_json::json!({ "key": counter }).to_string()).map_err(describe)?;
                    let count = serde_json::from_str::<Value>(&got).ok().and_then(|c| c.as_u64()).unwrap_or(0);
                    let put = serde_json::json!({ "key": counter, "value": count + 1 });
                    effect("kv.put", &put.to_string()).map_err(describe)?;
                    for (name, kind) in [("http", "keyed"), ("http.unkeyed", "unkeyed")] {
                        let body = serde_json::json!({ "tag": tag, "step": i, "kind": kind, "delay_ms": v["delay_ms"] });
                        let request = serde_json::json!({ "method": "POST", "url": v["url"], "body": body });
                        match effect(name, &request.to_string()) {
                            Ok(_) => {}
                            Err(EffectError::InDoubt(_)) => in_doubt += 1,
                            Err(e) => return Err(describe(e)),
                        }
                    }
                    emit(&format!("step {i} "));
                }
                spin(spins);
                Ok(format!("did {n} chaos steps, {in_doubt} in doubt"))
            }
            "put-then-spin" => {
                effect("kv.put", r#"{"key":"early","value":1}"#).map_err(describe)?;
                spin(v["spins"].as_u64().unwrap_or(1 << 32));
                Ok("spun".to_string())
            }
            "emit-then-spin" => {
                emit("early ");
                spin(v["spins"].as_u64().unwrap_or(1 << 32));
                emit("late");
                Ok("spun".to_string())
            }
            "calls" => {
                let n = v["n"].as_u64().unwrap_or(0);
                for _ in 0..n {
                    leasehold::turn::host::log(0, "");
                }
                Ok(format!("made {n} calls"))
            }
            "wait" => {
                let name = wait_input("What is your name?");
                Ok(format!("hello {name}"))
            }
            "sleep" => {
                sleep(v["ms"].as_u64().unwrap_or(1000));
                Ok("woke".to_string())
            }
            "spin-then-put" => {
                let mut x: u64 = 0;
                for i in 0..v["spins"].as_u64().unwrap_or(1 << 32) {
                    x = std::hint::black_box(x.wrapping_add(i));
                }
                effect("kv.put", r#"{"key":"after-spin","value":1}"#).map_err(describe)?;
                Ok(format!("spun {x}"))
            }
            "http" => {
                spin(v["spin_before"].as_u64().unwrap_or(0));
                let name = if v["keyed"].as_bool().unwrap_or(true) { "http" } else { "http.unkeyed" };
                let request = serde_json::json!({ "method": "POST", "url": v["url"], "body": { "from": "testkit" } });
                let out = match effect(name, &request.to_string()) {
                    Ok(result) => result,
                    Err(EffectError::InDoubt(m)) if !v["fail_in_doubt"].as_bool().unwrap_or(false) => format!("in-doubt: {m}"),
                    Err(e) => return Err(describe(e)),
                };
                spin(v["spin_after"].as_u64().unwrap_or(0));
                Ok(out)
            }
            "http-steps" => {
                let n = v["steps"].as_u64().unwrap_or(3);
                for i in 0..n {
                    let request = serde_json::json!({ "method": "POST", "url": v["url"], "body": { "step": i } });
                    effect("http", &request.to_string()).map_err(describe)?;
                    emit(&format!("step {i} "));
                }
                Ok(format!("did {n} http steps"))
            }
            "loop" => {
                let mut x: u64 = 0;
                loop {
                    x = std::hint::black_box(x.wrapping_add(1));
                }
            }
            "oom" => {
                let mut hoard: Vec<Vec<u8>> = Vec::new();
                loop {
                    hoard.push(std::hint::black_box(vec![1u8; 1 << 20]));
                }
            }
            "emit-bomb" => {
                let chunk = "x".repeat(1 << 20);
                loop {
                    emit(&chunk);
                }
            }
            "trap" => std::process::abort(),
            "panic" => panic!("{}", v["message"].as_str().unwrap_or("boom")),
            "print" => {
                for i in 0..v["lines"].as_u64().unwrap_or(1) {
                    eprintln!("line {i} on stderr");
                    println!("line {i} on stdout");
                }
                Ok("printed".to_string())
            }
            "big-output" => Ok("x".repeat(2 << 20)),
            "fail" => Err("the turn gave up".to_string()),
            "nul" => {
                emit("a\0b");
                let bad_key = match effect("kv.put", r#"{"key":"k\u0000","value":1}"#) {
                    Ok(r) => format!("ok {r}"),
                    Err(e) => describe(e),
                };
                let bad_name = match effect("no\0such", "{}") {
                    Ok(r) => format!("ok {r}"),
                    Err(e) => describe(e),
                };
                Ok(format!("x\0y | {bad_key} | {bad_name}"))
            }
            "nul-fail" => Err("gave\0up".to_string()),
            "script" => script(&v["ops"]),
            "big-name" => {
                let name = "a".repeat(8 << 20);
                effect(&name, "{}").map_err(describe)
            }
            "long-name" => Ok(match effect(&"a".repeat(300), "{}") {
                Ok(r) => format!("ok {r}"),
                Err(e) => describe(e),
            }),
            "bad-name" => Ok(match effect("Bad Name!", "{}") {
                Ok(r) => format!("ok {r}"),
                Err(e) => describe(e),
            }),
            "big-prompt" => Ok(wait_input(&"?".repeat(1 << 20))),
            "log-flood" => {
                let n = v["n"].as_u64().unwrap_or(100_000);
                for i in 0..n {
                    leasehold::turn::host::log(2, &format!("line {i}\n\u{1b}[31mfake\r\u{0}"));
                }
                Ok(format!("logged {n}"))
            }
            "random-bomb" => Ok(format!("{} bytes", wasip2::random::random::get_random_bytes(1 << 30).len())),
            "table-bomb" => {
                let mut kept = Vec::new();
                loop {
                    kept.push(wasip2::clocks::monotonic_clock::subscribe_duration(1_000_000_000));
                }
            }
            "kv-big" => {
                let value = "x".repeat(v["bytes"].as_u64().unwrap_or(1 << 17) as usize);
                let request = serde_json::json!({ "key": "big", "value": value });
                effect("kv.put", &request.to_string()).map_err(describe)?;
                Ok("put".to_string())
            }
            "gets" => {
                let n = v["n"].as_u64().unwrap_or(10);
                for _ in 0..n {
                    effect("kv.get", r#"{"key":"k"}"#).map_err(describe)?;
                }
                Ok(format!("did {n} gets"))
            }
            other => Err(format!("unknown mode {other:?}")),
        }
    }
}

/// The `script` mode: each op's result, in order.
fn script(ops: &Value) -> Result<String, String> {
    let mut out = Vec::new();
    for op in ops.as_array().into_iter().flatten() {
        let got = match op["op"].as_str().unwrap_or("") {
            "put" => {
                let request = serde_json::json!({ "key": op["key"], "value": op["value"] });
                effect("kv.put", &request.to_string()).map_err(describe)?;
                Value::Null
            }
            "emit" => {
                emit(op["text"].as_str().unwrap_or(""));
                Value::Null
            }
            "sleep" => {
                sleep(op["ms"].as_u64().unwrap_or(0));
                Value::Null
            }
            "wasi-sleep" => {
                std::thread::sleep(std::time::Duration::from_millis(op["ms"].as_u64().unwrap_or(0)));
                Value::Null
            }
            "chat" => {
                let request = serde_json::json!({ "messages": [{ "role": "user", "content": op["prompt"] }] });
                match effect("model.chat", &request.to_string()) {
                    Ok(r) => serde_json::from_str::<Value>(&r).map(|v| v["content"].clone()).unwrap_or(Value::Null),
                    Err(e) => Value::String(describe(e)),
                }
            }
            "http" => {
                let name = if op["keyed"].as_bool().unwrap_or(true) { "http" } else { "http.unkeyed" };
                let request = serde_json::json!({ "method": "POST", "url": op["url"], "body": op["body"] });
                match effect(name, &request.to_string()) {
                    Ok(r) => serde_json::from_str::<Value>(&r).map(|v| v["body"].clone()).unwrap_or(Value::Null),
                    Err(e) => Value::String(describe(e)),
                }
            }
            "put-random" => {
                let bytes = wasip2::random::random::get_random_bytes(16);
                let hex: String = bytes.iter().map(|b| format!("{b:02x}")).collect();
                let request = serde_json::json!({ "key": op["key"], "value": hex });
                effect("kv.put", &request.to_string()).map_err(describe)?;
                Value::String(hex)
            }
            "random" => {
                let bytes = wasip2::random::random::get_random_bytes(op["bytes"].as_u64().unwrap_or(8));
                Value::String(bytes.iter().map(|b| format!("{b:02x}")).collect())
            }
            "clock" => {
                let wall = wasip2::clocks::wall_clock::now();
                let mono = wasip2::clocks::monotonic_clock::now();
                serde_json::json!({
                    "monotonic_ms": mono / 1_000_000,
                    "wall_ms": wall.seconds * 1000 + u64::from(wall.nanoseconds) / 1_000_000,
                })
            }
            "wait" => Value::String(wait_input(op["prompt"].as_str().unwrap_or("?"))),
            "effect" => {
                let name = op["name"].as_str().unwrap_or("");
                match effect(name, op["request"].as_str().unwrap_or("{}")) {
                    Ok(r) => Value::String(r),
                    Err(e) => Value::String(describe(e)),
                }
            }
            other => return Err(format!("unknown op {other:?}")),
        };
        out.push(got);
    }
    Ok(Value::Array(out).to_string())
}

fn spin(n: u64) {
    let mut x: u64 = 0;
    for i in 0..n {
        x = std::hint::black_box(x.wrapping_add(i));
    }
    std::hint::black_box(x);
}

export!(Testkit);
