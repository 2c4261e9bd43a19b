//! The test plugin. The input's `mode` picks the behaviour:
//!
//! * `steps` (default): `steps` times, burns `spin` iterations (default 0),
//!   `kv.put` key `<prefix>-<i>` then emits `"step <i> "`; returns
//!   `"did <n> steps"`. Deterministic, one effect per step: for crash,
//!   replay and bench tests.
//! * `wait`: asks for input, returns `"hello <input>"`.
//! * `sleep`: sleeps `ms`, returns `"woke"`.
//! * `spin-then-put`: burns CPU for `spins` iterations, then `kv.put`.
//! * `http`: burns `spin_before` iterations, POSTs to `url` with `http` (or
//!   `http.unkeyed` when `keyed` is false), burns `spin_after`, and returns
//!   the result, or `"in-doubt: …"` when the host reports it in doubt.
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
//! * hostile: `loop` (never returns), `oom` (allocates without bound),
//!   `emit-bomb` (emits 1 MiB chunks forever), `trap` (unreachable),
//!   `big-output` (returns 2 MiB), `fail` (returns an error), `nul` (emits,
//!   puts a key, calls an effect and returns text, each holding a NUL),
//!   `nul-fail` (returns an error holding a NUL).

wit_bindgen::generate!({ path: "../../wit", world: "turn" });

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
                    let request = serde_json::json!({ "key": format!("{prefix}-{i}"), "value": i });
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
                    Err(EffectError::InDoubt(m)) => format!("in-doubt: {m}"),
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
            other => Err(format!("unknown mode {other:?}")),
        }
    }
}

fn spin(n: u64) {
    let mut x: u64 = 0;
    for i in 0..n {
        x = std::hint::black_box(x.wrapping_add(i));
    }
    std::hint::black_box(x);
}

export!(Testkit);
