//! The HTTP API end to end, in process: a real listener, the worker pool
//! and the reaper's store, on both backends. Requests go over TCP with
//! reqwest, as a client's would.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::api::ApiConfig;
use leasehold::store::NewRun;
use serde_json::{Value, json};

use crate::harness::{Server, TestDb, both, eventually_some};
use crate::plugins;

async fn with_testkit(db: &TestDb, token: Option<&str>) -> Result<Server> {
    let server = Server::start(db, token).await?;
    let (status, body) = server.put_plugin("testkit", plugins::rust_plugin("testkit")?).await?;
    ensure!(status == 201 && body["digest"].as_str().is_some_and(|d| d.starts_with("sha256:")), "{status} {body}");
    Ok(server)
}

both! {
    async fn leases_name_each_holder_its_runs_and_the_runs_taken_over(db) {
        let server = Server::start_with(db, None, false, |_| {}).await?;
        let s = &db.store;
        let ids: Vec<i64> = s.create_runs(&(0..3).map(|i| NewRun::new("testkit", i.to_string())).collect::<Vec<_>>()).await?.iter().map(|(r, _)| r.id).collect();
        let a = s.claim("host-a", crate::harness::TTL).await?.context("a claim")?;
        let b = s.claim("host-b", crate::harness::TTL).await?.context("a claim")?;
        // host-b's lease runs out; host-c takes the run over (fence 2).
        db.backdate_lease(b.run.id, 3_600_000).await?;
        let c = s.claim("host-c", crate::harness::TTL).await?.context("a takeover")?;
        ensure!(c.run.id == b.run.id && c.lease.fence == 2, "{c:?}");
        let (status, leases) = server.get("/v1/leases").await?;
        ensure!(status == 200, "{status} {leases}");
        let now = db.store.now_ms().await?;
        ensure!((now - leases["now"].as_i64().unwrap_or(0)).abs() < 5_000, "{leases}");
        let holders: Vec<(String, Vec<(i64, i64)>)> = leases["holders"]
            .as_array()
            .context("holders")?
            .iter()
            .map(|h| (h["owner"].as_str().unwrap_or("").to_string(), h["runs"].as_array().map(|r| r.iter().map(|r| (r["id"].as_i64().unwrap_or(0), r["fence"].as_i64().unwrap_or(0))).collect()).unwrap_or_default()))
            .collect();
        let want = vec![("host-a".to_string(), vec![(a.run.id, 1)]), ("host-c".to_string(), vec![(c.run.id, 2)])];
        let mut got = holders.clone();
        got.sort();
        ensure!(got == want, "holders {holders:?}, not {want:?}");
        let taken: Vec<i64> = leases["takeovers"].as_array().context("takeovers")?.iter().filter_map(|t| t["id"].as_i64()).collect();
        ensure!(taken == vec![c.run.id], "takeovers {taken:?} of {ids:?}");
        ensure!(leases["fenced_writes_rejected"].is_u64() && leases["leases_lost"].is_u64(), "{leases}");
        server.stop().await;
        Ok(())
    }

    async fn a_runs_children_come_in_pages_and_an_unknown_run_is_a_404(db) {
        let server = Server::start_with(db, None, false, |_| {}).await?;
        let s = &db.store;
        let ids: Vec<i64> = s.create_runs(&(0..6).map(|i| NewRun::new("testkit", i.to_string())).collect::<Vec<_>>()).await?.iter().map(|(r, _)| r.id).collect();
        // Five children of the first run, as a spawn writes them.
        let parent = ids[0];
        for child in &ids[1..] {
            sqlx::query("UPDATE runs SET parent_id = $1, root_id = $1 WHERE id = $2").bind(parent).bind(child).execute(s.pool()).await?;
        }
        let mut seen = Vec::new();
        let mut path = format!("/v1/runs/{parent}/children?limit=2");
        loop {
            let (status, page) = server.get(&path).await?;
            ensure!(status == 200, "{status} {page}");
            let runs = page["runs"].as_array().context("runs")?;
            ensure!(runs.len() <= 2, "a page of {} past its limit of 2", runs.len());
            seen.extend(runs.iter().filter_map(|r| r["id"].as_i64()));
            match page["next_cursor"].as_i64() {
                Some(cursor) => path = format!("/v1/runs/{parent}/children?limit=2&cursor={cursor}"),
                None => break,
            }
            ensure!(seen.len() <= 5, "the pages go on past the five children: {seen:?}");
        }
        let newest_first: Vec<i64> = ids[1..].iter().rev().copied().collect();
        ensure!(seen == newest_first, "children {seen:?}, not {newest_first:?}");
        let (status, body) = server.get("/v1/runs/999999/children").await?;
        ensure!(status == 404 && body["error"]["code"] == "not_found", "{status} {body}");
        let (status, body) = server.get(&format!("/v1/runs/{parent}/children?limit=0")).await?;
        ensure!(status == 400, "{status} {body}");
        server.stop().await;
        Ok(())
    }
}

both! {
    async fn a_submitted_turn_streams_its_events_and_completes(db) {
        let server = with_testkit(db, None).await?;
        let (status, plugins) = server.get("/v1/plugins").await?;
        ensure!(status == 200 && plugins["plugins"][0]["name"] == "testkit", "{plugins}");
        let (status, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "steps": 3 } })).await?;
        ensure!(status == 201 && run["status"] == "queued", "{status} {run}");
        let id = run["id"].as_i64().unwrap();
        let thread = run["thread_id"].as_str().unwrap().to_string();
        let events = server.read_sse(&format!("/v1/threads/{thread}/events"), None, |e| e["kind"] == "message").await?;
        let kinds: Vec<&str> = events.iter().map(|e| e["kind"].as_str().unwrap_or("")).collect();
        ensure!(kinds == ["submitted", "delta", "delta", "delta", "message"], "{kinds:?}");
        ensure!(events.iter().all(|e| e["run_id"] == id && e["fence"].is_i64()), "{events:?}");
        ensure!(events[4]["payload"]["output"] == "did 3 steps" && events[4]["fence"] == 1, "{}", events[4]);
        // Resuming from the third event gives the rest.
        let rest = server.read_sse(&format!("/v1/threads/{thread}/events"), Some(3), |e| e["kind"] == "message").await?;
        ensure!(rest.first().map(|e| e["seq"].clone()) == Some(json!(4)) && rest.len() == 2, "{rest:?}");
        let (_, run) = server.get(&format!("/v1/runs/{id}")).await?;
        ensure!(run["status"] == "completed" && run["output"] == "did 3 steps" && run["partial"] == "step 0 step 1 step 2 ");
        let (status, effects) = server.get(&format!("/v1/runs/{id}/effects")).await?;
        ensure!(status == 200 && effects["effects"].as_array().map(Vec::len) == Some(3), "{effects}");
        let (_, list) = server.get("/v1/runs?status=completed&plugin=testkit").await?;
        ensure!(list["runs"][0]["id"] == id, "{list}");
        // The plugin shows what its kv holds (three keys of step-i = i) against its quota.
        let (status, plugin) = server.get("/v1/plugins/testkit").await?;
        ensure!(status == 200 && plugin["kv_usage"] == json!({ "keys": 3, "bytes": 3 * 7 }), "{status} {plugin}");
        ensure!(plugin["settings"]["kv"] == json!({ "max_bytes": 256 << 20, "max_keys": 100_000 }), "{plugin}");
        let (_, json_events) = server.get(&format!("/v1/threads/{thread}/events?after=4")).await?;
        ensure!(json_events["events"].as_array().map(Vec::len) == Some(1), "{json_events}");
        server.stop().await;
        Ok(())
    }

    async fn input_resumes_a_waiting_run_and_a_second_delivery_conflicts(db) {
        let server = with_testkit(db, None).await?;
        let (_, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "mode": "wait" } })).await?;
        let id = run["id"].as_i64().unwrap();
        server.wait_status(id, "waiting_input").await?;
        let (status, _) = server.post(&format!("/v1/runs/{id}/input"), json!({ "input": "Ada" })).await?;
        ensure!(status == 200);
        let (status, again) = server.post(&format!("/v1/runs/{id}/input"), json!({ "input": "Bob" })).await?;
        ensure!(status == 409 && again["error"]["code"] == "conflict", "{status} {again}");
        let run = server.wait_status(id, "completed").await?;
        ensure!(run["output"] == "hello Ada", "{run}");
        let (status, late) = server.post(&format!("/v1/runs/{id}/input"), json!({ "input": "late" })).await?;
        ensure!(status == 409, "{status} {late}");
        server.stop().await;
        Ok(())
    }

    async fn submit_is_idempotent_and_cancel_is_final(db) {
        let server = with_testkit(db, None).await?;
        let body = json!({ "plugin": "testkit", "input": { "mode": "wait" }, "idempotency_key": "order-7" });
        let (s1, first) = server.post("/v1/runs", body.clone()).await?;
        let (s2, second) = server.post("/v1/runs", body).await?;
        ensure!(s1 == 201 && s2 == 200 && first["id"] == second["id"], "{s1} {s2} {first} {second}");
        let other = json!({ "plugin": "testkit", "input": { "mode": "other" }, "idempotency_key": "order-7" });
        let (s3, conflict) = server.post("/v1/runs", other).await?;
        ensure!(s3 == 409 && conflict["error"]["code"] == "idempotency_conflict", "{s3} {conflict}");
        let id = first["id"].as_i64().unwrap();
        server.wait_status(id, "waiting_input").await?;
        let (status, run) = server.post(&format!("/v1/runs/{id}/cancel"), json!({})).await?;
        ensure!(status == 200 && run["status"] == "cancelled", "{status} {run}");
        let (status, _) = server.post(&format!("/v1/runs/{id}/cancel"), json!({})).await?;
        ensure!(status == 409);
        server.stop().await;
        Ok(())
    }

    async fn a_batch_submit_writes_its_runs_in_order_once_and_refuses_a_bad_run_whole(db) {
        let server = with_testkit(db, None).await?;
        let runs: Vec<Value> = (0..5).map(|i| json!({ "plugin": "testkit", "input": { "steps": i }, "idempotency_key": format!("b{i}") })).collect();
        let (status, body) = server.post("/v1/runs:batch", json!({ "runs": runs })).await?;
        ensure!(status == 200, "{status} {body}");
        let results = body["results"].as_array().context("results")?;
        ensure!(results.len() == 5 && results.iter().all(|r| r["created"] == true), "{body}");
        let ids: Vec<i64> = results.iter().map(|r| r["run"]["id"].as_i64().unwrap()).collect();
        ensure!(ids.windows(2).all(|w| w[0] < w[1]), "ids out of order: {ids:?}");
        for (i, id) in ids.iter().enumerate() {
            let run = server.wait_status(*id, "completed").await?;
            ensure!(run["output"] == format!("did {i} steps"), "{run}");
        }
        // Sent again (its answer lost, say): nothing new; a changed request
        // under a used key is refused on its own.
        let mut again = runs.clone();
        again[2]["input"] = json!({ "steps": 9 });
        again.push(json!({ "plugin": "testkit", "input": {}, "idempotency_key": "b5" }));
        let (status, body) = server.post("/v1/runs:batch", json!({ "runs": again })).await?;
        ensure!(status == 200, "{status} {body}");
        let r = body["results"].as_array().context("results")?;
        ensure!(r[0]["created"] == false && r[0]["run"]["id"] == ids[0], "{body}");
        ensure!(r[2]["error"]["code"] == "idempotency_conflict" && r[5]["created"] == true, "{body}");
        let (_, list) = server.get("/v1/runs?limit=100").await?;
        ensure!(list["runs"].as_array().map(Vec::len) == Some(6), "{list}");
        // A bad run anywhere in a batch: 4xx naming it, and nothing written.
        let bad = [
            (json!({ "runs": [{ "plugin": "testkit", "idempotency_key": "c0" }, { "plugin": "testkit" }] }), 400, "runs[1]: idempotency_key is required"),
            (json!({ "runs": [{ "plugin": "testkit", "idempotency_key": "c0" }, { "plugin": "nope", "idempotency_key": "c1" }] }), 404, "runs[1]: no plugin"),
            (json!({ "runs": [{ "plugin": "testkit", "idempotency_key": "c0", "max_attempts": 0 }] }), 400, "runs[0]: max_attempts"),
            (json!({ "runs": [{ "plugin": "testkit", "idempotency_key": "c0" }, { "plugin": "testkit", "idempotency_key": "c1", "priority": -1001 }] }), 400, "runs[1]: priority must be between -1000 and 1000"),
            (json!({ "runs": [{ "plugin": "testkit", "idempotency_key": "c0" }, { "plugin": "testkit", "idempotency_key": "c0" }] }), 400, "already used by this batch"),
            (json!({ "runs": [{ "plugin": "testkit", "idempotency_key": "c0", "thread_id": "t" }, { "plugin": "testkit", "idempotency_key": "c1", "thread_id": "t" }] }), 400, "names each thread once"),
            (json!({ "runs": [] }), 400, "1 to 1000 runs"),
            (json!({ "runs": (0..1001).map(|i| json!({ "plugin": "testkit", "idempotency_key": format!("d{i}") })).collect::<Vec<_>>() }), 400, "not 1001"),
        ];
        for (req, want, says) in bad {
            let (status, body) = server.post("/v1/runs:batch", req).await?;
            ensure!(status == want && body["error"]["message"].as_str().is_some_and(|m| m.contains(says)), "{status} {body}");
        }
        let (_, list) = server.get("/v1/runs?limit=100").await?;
        ensure!(list["runs"].as_array().map(Vec::len) == Some(6), "a refused batch wrote runs: {list}");
        server.stop().await;
        Ok(())
    }

    async fn bad_requests_get_a_4xx_with_a_json_error(db) {
        let server = with_testkit(db, None).await?;
        let raw = |path: &str, body: &'static [u8]| server.req(reqwest::Method::POST, path).header("content-type", "application/json").body(body);
        let cases: Vec<(&str, reqwest::RequestBuilder, u16)> = vec![
            ("malformed JSON", raw("/v1/runs", b"{\"plugin\": "), 400),
            ("wrong shape", raw("/v1/runs", b"{\"plugin\": 7}"), 400),
            ("unknown field", raw("/v1/runs", b"{\"plugin\": \"testkit\", \"colour\": 1}"), 400),
            ("unknown plugin", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "nope" })), 404),
            ("priority out of range", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "priority": 1001 })), 400),
            ("fractional priority", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "priority": 1.5 })), 400),
            ("unknown run", server.req(reqwest::Method::GET, "/v1/runs/999999"), 404),
            ("non-numeric run id", server.req(reqwest::Method::GET, "/v1/runs/abc"), 400),
            ("ledger of unknown run", server.req(reqwest::Method::GET, "/v1/runs/999999/effects"), 404),
            ("input to unknown run", server.req(reqwest::Method::POST, "/v1/runs/999999/input").json(&json!({ "input": "x" })), 404),
            ("bad status filter", server.req(reqwest::Method::GET, "/v1/runs?status=bogus"), 400),
            ("bad limit", server.req(reqwest::Method::GET, "/v1/runs?limit=0"), 400),
            ("oversized body", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "input": "x".repeat(70 << 10) })), 413),
            ("not a component", server.req(reqwest::Method::PUT, "/v1/plugins/junk").body(b"not wasm".to_vec()), 422),
            ("empty component", server.req(reqwest::Method::PUT, "/v1/plugins/junk").body(Vec::new()), 422),
            ("core module", server.req(reqwest::Method::PUT, "/v1/plugins/junk").body(wat_core()), 422),
            ("missing import", server.req(reqwest::Method::PUT, "/v1/plugins/junk").body(plugins::hostile_wat("missing-import.wat")?), 422),
            ("bad plugin name", server.req(reqwest::Method::PUT, "/v1/plugins/Bad%20Name").body(b"x".to_vec()), 400),
            ("bad upgrade policy", server.req(reqwest::Method::PUT, "/v1/plugins/testkit?upgrade=sometimes").body(b"x".to_vec()), 400),
            ("zero kv quota", server.req(reqwest::Method::PUT, "/v1/plugins/testkit?kv_max_keys=0").body(b"x".to_vec()), 400),
            ("zero key default", server.req(reqwest::Method::PUT, "/v1/plugins/testkit?key_concurrency=0").body(b"x".to_vec()), 400),
            ("unknown plugin", server.req(reqwest::Method::GET, "/v1/plugins/nothing"), 404),
            ("unknown endpoint", server.req(reqwest::Method::GET, "/v1/nothing"), 404),
            ("wrong method", server.req(reqwest::Method::DELETE, "/v1/runs"), 405),
            ("reserved concurrency key", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "concurrency_key": "http:a:1" })), 400),
            ("empty concurrency key", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "concurrency_key": "" })), 400),
            ("long concurrency key", server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "concurrency_key": "k".repeat(257) })), 400),
            ("zero limit", server.req(reqwest::Method::PUT, "/v1/limits/k").json(&json!({ "concurrency": 0 })), 400),
            ("fractional limit", server.req(reqwest::Method::PUT, "/v1/limits/k").json(&json!({ "concurrency": 1.5 })), 400),
            ("unknown limit field", server.req(reqwest::Method::PUT, "/v1/limits/k").json(&json!({ "per_hour": 3 })), 400),
            ("limit as a form", server.req(reqwest::Method::PUT, "/v1/limits/k").header("content-type", "application/x-www-form-urlencoded").body("concurrency=1"), 415),
            ("limit on a reserved key", server.req(reqwest::Method::PUT, "/v1/limits/model:x").json(&json!({ "concurrency": 1 })), 400),
            ("limit with a control character", server.req(reqwest::Method::PUT, "/v1/limits/a%01b").json(&json!({ "concurrency": 1 })), 400),
            ("limit as an array", server.req(reqwest::Method::PUT, "/v1/limits/k").json(&json!([null, null])), 400),
            ("submit as an array", server.req(reqwest::Method::POST, "/v1/runs").json(&json!(["testkit", "{}"])), 400),
            ("rate on a concurrency key", server.req(reqwest::Method::PUT, "/v1/limits/k").json(&json!({ "per_minute": 60 })), 400),
            ("rate key without a port", server.req(reqwest::Method::PUT, "/v1/limits/http:api.example").json(&json!({ "per_minute": 60 })), 400),
            ("rate key in capitals", server.req(reqwest::Method::PUT, "/v1/limits/http:API.example:443").json(&json!({ "per_minute": 60 })), 400),
            ("rate key without a rate", server.req(reqwest::Method::PUT, "/v1/limits/http:api.example:443").json(&json!({})), 400),
            ("tokens on an http key", server.req(reqwest::Method::PUT, "/v1/limits/http:api.example:443").json(&json!({ "tokens_per_minute": 9 })), 400),
            ("zero rate", server.req(reqwest::Method::PUT, "/v1/limits/model:m").json(&json!({ "per_minute": 0 })), 400),
            ("paused rate key", server.req(reqwest::Method::PUT, "/v1/limits/model:m").json(&json!({ "per_minute": 1, "paused": true })), 400),
            ("unknown rate key", server.req(reqwest::Method::GET, "/v1/limits/model:nobody"), 404),
            ("unknown key", server.req(reqwest::Method::GET, "/v1/limits/nobody"), 404),
            ("removing no limit", server.req(reqwest::Method::DELETE, "/v1/limits/nobody"), 404),
            ("bad limits page", server.req(reqwest::Method::GET, "/v1/limits?limit=0"), 400),
        ];
        for (what, req, want) in cases {
            let (status, body) = server.send(req).await.with_context(|| what.to_string())?;
            ensure!(status == want, "{what}: got {status}, want {want}: {body}");
            ensure!(body["error"]["code"].is_string() && body["error"]["message"].is_string(), "{what}: {body}");
        }
        let (status, body) = server.put_plugin("junk", b"not wasm".to_vec()).await?;
        ensure!(body["error"]["message"].as_str().is_some_and(|m| m.contains("not a valid component")), "{status} {body}");
        let (_, body) = server.put_plugin("junk", plugins::hostile_wat("missing-import.wat")?).await?;
        ensure!(body["error"]["message"].as_str().is_some_and(|m| m.contains("leasehold:turn")), "{body}");
        // Input to a run that is not waiting: 409.
        let (_, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "steps": 1 } })).await?;
        let id = run["id"].as_i64().unwrap();
        server.wait_status(id, "completed").await?;
        let (status, body) = server.post(&format!("/v1/runs/{id}/input"), json!({ "input": "x" })).await?;
        ensure!(status == 409 && body["error"]["code"] == "conflict", "{status} {body}");
        server.stop().await;
        Ok(())
    }

    async fn a_keys_limit_is_set_shown_listed_and_removed_and_holds_its_runs(db) {
        let server = with_testkit(db, None).await?;
        let (status, set) = server
            .send(server.req(reqwest::Method::PUT, "/v1/limits/tenant%2F1").json(&json!({ "concurrency": 1, "paused": true })))
            .await?;
        ensure!(status == 200 && set["key"] == "tenant/1" && set["concurrency"] == 1 && set["paused"] == true, "{status} {set}");
        let claims = leasehold::metrics::global().claim_latency.count();
        let (status, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "steps": 1 }, "concurrency_key": "tenant/1" })).await?;
        ensure!(status == 201 && run["concurrency_key"] == "tenant/1", "{status} {run}");
        let id = run["id"].as_i64().context("id")?;
        // Paused: the pool looks (two claims: one begun after the submit)
        // and does not take it.
        let looked = async || Ok(leasehold::metrics::global().claim_latency.count() >= claims + 2);
        crate::harness::eventually("the pool never claimed after the submit", looked).await?;
        let (_, shown) = server.get("/v1/limits/tenant%2F1").await?;
        ensure!(shown["queued"] == 1 && shown["running"] == 0, "{shown}");
        let (_, listed) = server.get("/v1/limits").await?;
        ensure!(listed["limits"][0]["key"] == "tenant/1" && listed["next"].is_null(), "{listed}");
        let status = server.req(reqwest::Method::DELETE, "/v1/limits/tenant%2F1").send().await?.status().as_u16();
        ensure!(status == 204, "delete: {status}");
        server.wait_status(id, "completed").await?;
        // Neither a limit nor runs: there is nothing to show.
        let (status, shown) = server.get("/v1/limits/tenant%2F1").await?;
        ensure!(status == 404, "{status} {shown}");
        server.stop().await;
        Ok(())
    }

    async fn a_rate_limit_is_set_shown_listed_beside_keys_and_removed(db) {
        let server = with_testkit(db, None).await?;
        let put = |key: &str, body: Value| server.req(reqwest::Method::PUT, &format!("/v1/limits/{key}")).json(&body);
        let (status, set) = server.send(put("model:gpt-4o-mini", json!({ "per_minute": 60, "tokens_per_minute": 200000 }))).await?;
        ensure!(status == 200 && set["per_minute"] == 60 && set["tokens_per_minute"] == 200000 && set["wait_ms"] == 0, "{status} {set}");
        let (status, _) = server.send(put("tenant", json!({ "concurrency": 2 }))).await?;
        ensure!(status == 200);
        let (status, set) = server.send(put("http:api.example.com:443", json!({ "per_minute": 600 }))).await?;
        ensure!(status == 200 && set["held_until"].is_null(), "{status} {set}");
        let (_, listed) = server.get("/v1/limits?limit=2").await?;
        let keys: Vec<&str> = listed["limits"].as_array().context("limits")?.iter().filter_map(|l| l["key"].as_str()).collect();
        ensure!(keys == ["http:api.example.com:443", "model:gpt-4o-mini"] && listed["next"] == "model:gpt-4o-mini", "{listed}");
        let (_, rest) = server.get("/v1/limits?limit=2&after=model:gpt-4o-mini").await?;
        ensure!(rest["limits"][0]["key"] == "tenant" && rest["limits"][0]["concurrency"] == 2, "{rest}");
        let (_, shown) = server.get("/v1/limits/http:api.example.com:443").await?;
        ensure!(shown["per_minute"] == 600, "{shown}");
        let status = server.req(reqwest::Method::DELETE, "/v1/limits/model:gpt-4o-mini").send().await?.status().as_u16();
        ensure!(status == 204, "delete: {status}");
        let (status, _) = server.get("/v1/limits/model:gpt-4o-mini").await?;
        ensure!(status == 404, "after delete: {status}");
        server.stop().await;
        Ok(())
    }

    async fn stats_give_the_database_clock_now_though_their_counts_are_cached(db) {
        // The dashboard sets its clock from `now`: a `now` as old as the
        // cached counts made times just past read as "in 300 ms".
        let server = Server::start(db, None).await?;
        let (status, first) = server.get("/v1/stats").await?;
        ensure!(status == 200, "{status} {first}");
        // A run submitted within the counts' 2 s cache: the second answer
        // does not count it yet, and its `now` is still the database's.
        db.store.create_run(&NewRun::new("testkit", "{}")).await?;
        tokio::time::sleep(Duration::from_millis(600)).await;
        let (_, second) = server.get("/v1/stats").await?;
        let db_now = db.store.now_ms().await?;
        let now = second["now"].as_i64().context("now")?;
        ensure!(second["runs"] == first["runs"], "the counts were not cached: {first} {second}");
        ensure!((db_now - now).abs() < 300, "stats say now is {now}, {} ms from the database's {db_now}", db_now - now);
        // Past the cache, the run is counted.
        let moved = async || Ok(server.get("/v1/stats").await?.1["runs"] != first["runs"]);
        crate::harness::eventually("the counts never moved past their cache", moved).await?;
        server.stop().await;
        Ok(())
    }

    async fn a_configured_token_is_required_on_every_v1_request(db) {
        let server = Server::start(db, Some("s3cret")).await?;
        let (status, _) = server.get("/v1/runs").await?;
        ensure!(status == 200);
        for auth in [None, Some("Bearer wrong"), Some("s3cret")] {
            let mut req = server.http.get(format!("{}/v1/runs", server.base));
            if let Some(a) = auth {
                req = req.header("authorization", a);
            }
            let (status, body) = server.send(req).await?;
            ensure!(status == 401 && body["error"]["code"] == "unauthorized", "{auth:?}: {status} {body}");
        }
        let health = server.http.get(format!("{}/healthz", server.base)).send().await?;
        ensure!(health.status() == 200);
        server.stop().await;
        Ok(())
    }

    async fn healthz_looks_at_the_database_at_most_once_a_period_for_any_number_of_callers(db) {
        let server = Server::start_with(db, None, false, |c| c.health_ttl = Duration::from_millis(300)).await?;
        let checked = || async {
            let r = server.http.get(format!("{}/healthz", server.base)).send().await?;
            anyhow::ensure!(r.status() == 200, "{}", r.status());
            let body: Value = r.json().await?;
            body["checked_at"].as_i64().ok_or_else(|| anyhow::anyhow!("no checked_at: {body}"))
        };
        // Twenty callers within the period: one look at the database.
        let first = checked().await?;
        for _ in 0..20 {
            let again = checked().await?;
            if again != first {
                // Past the period (a slow machine): the next look is newer.
                ensure!(again > first, "{again} before {first}");
                break;
            }
        }
        let started = std::time::Instant::now();
        let mut times = std::collections::HashSet::new();
        while started.elapsed() < Duration::from_millis(250) {
            times.insert(checked().await?);
        }
        ensure!(times.len() <= 2, "{} looks at the database in 250 ms with a 300 ms period", times.len());
        // Past its period it looks again: polled, not slept for, so a slow
        // machine waits longer rather than fails.
        eventually_some(
            Duration::from_secs(10),
            async || Ok("healthz kept an old look 10 s past its 300 ms period".into()),
            async || Ok((checked().await? > first).then_some(())),
        )
        .await?;
        server.stop().await;
        Ok(())
    }

    async fn hostile_strings_never_get_a_5xx_or_change_the_schema(db) {
        let server = with_testkit(db, None).await?;
        let schema = || async {
            let q = match db.backend {
                leasehold::Backend::Sqlite => "SELECT name FROM sqlite_master ORDER BY name",
                leasehold::Backend::Postgres => "SELECT table_name::text FROM information_schema.tables WHERE table_schema = 'public' ORDER BY table_name",
            };
            sqlx::query_scalar::<_, String>(q).fetch_all(db.store.pool()).await
        };
        let before = schema().await?;
        let seed: u64 = std::env::var("LEASEHOLD_SEED").ok().and_then(|s| s.parse().ok()).unwrap_or(0x5eed);
        let mut rng = Rng(seed);
        let nasty = ["'", "\"", "'; DROP TABLE runs; --", "\0", "%00", "\\", "../../etc/passwd", "$1", "?", "\u{202e}", "😀", "%", "%ff", ")", "/*", "' OR '1'='1"];
        for i in 0..300 {
            let mut s = String::new();
            for _ in 0..rng.below(6) {
                s.push_str(nasty[rng.below(nasty.len() as u64) as usize]);
            }
            // Long values in bodies; URLs stay under the URI length limit.
            let enc: String = url::form_urlencoded::byte_serialize(s.as_bytes()).collect();
            if i % 50 == 0 {
                // Long, but under the test server's 64 KiB body limit (the
                // limit itself has its own case).
                s.push_str(&"A".repeat(30_000));
            }
            let path_enc = enc.replace('+', "%20");
            let mut bytes = s.clone().into_bytes();
            if i % 3 == 0 {
                bytes.extend_from_slice(&[0xff, 0xfe, 0x00, 0xc3]);
            }
            let reqs = vec![
                server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": s, "input": s })),
                server.req(reqwest::Method::POST, "/v1/runs").json(&json!({ "plugin": "testkit", "input": { "steps": 0, "x": s }, "thread_id": s, "idempotency_key": s })),
                server.req(reqwest::Method::POST, "/v1/runs").header("content-type", "application/json").body(bytes.clone()),
                server.req(reqwest::Method::GET, &format!("/v1/runs?status={enc}&plugin={enc}&cursor={enc}")),
                server.req(reqwest::Method::GET, &format!("/v1/runs?plugin={enc}")),
                server.req(reqwest::Method::GET, &format!("/v1/runs/{path_enc}")),
                server.req(reqwest::Method::GET, &format!("/v1/threads/{path_enc}/events?after={enc}")),
                server.req(reqwest::Method::GET, &format!("/v1/threads/{path_enc}/events")),
                server.req(reqwest::Method::POST, "/v1/runs/1/input").header("content-type", "application/json").body(bytes.clone()),
                server.req(reqwest::Method::POST, "/v1/runs/1/input").json(&json!({ "input": s })),
                server.req(reqwest::Method::PUT, &format!("/v1/plugins/{path_enc}?http_allow={enc}")).body(bytes.clone()),
                server.req(reqwest::Method::PUT, &format!("/v1/plugins/testkit?upgrade={enc}")).body(bytes.clone()),
            ];
            for req in reqs {
                let resp = req.send().await?;
                let status = resp.status().as_u16();
                let text = resp.text().await?;
                let short: String = s.chars().take(80).collect();
                ensure!(status < 500, "seed {seed}, case {i} ({short:?}): {status} {text}");
                ensure!(serde_json::from_str::<Value>(&text).is_ok(), "seed {seed}, case {i}: non-JSON {status} {text:?}");
            }
        }
        ensure!(schema().await? == before, "the schema changed");
        server.stop().await;
        Ok(())
    }

    async fn shutdown_suspends_a_running_turn_for_another_host(db) {
        let server = with_testkit(db, None).await?;
        // Spins for a long time, then puts: still running at shutdown.
        let (_, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "mode": "spin-then-put", "spins": 1u64 << 40 } })).await?;
        let id = run["id"].as_i64().unwrap();
        server.wait_status(id, "running").await?;
        let mut server = server;
        let pool = server.take_pool().context("a pool")?;
        tokio::time::timeout(Duration::from_secs(20), pool.shutdown(Duration::from_millis(100))).await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.status == leasehold::store::RunStatus::WaitingTakeover && run.lease_owner.is_none(), "{run:?}");
        server.stop().await;
        Ok(())
    }
}

both! {
    async fn cross_site_requests_and_rebound_host_names_are_refused(db) {
        // A web page the operator opens can send a `text/plain` POST without
        // a preflight, and a DNS-rebinding page can make its own name point
        // at the API. Neither may reach it.
        let server = with_testkit(db, None).await?;
        let body = json!({ "plugin": "testkit", "input": { "steps": 1 } }).to_string();
        let plain = server.req(reqwest::Method::POST, "/v1/runs").header("content-type", "text/plain").body(body.clone());
        let (status, err) = server.send(plain).await?;
        ensure!(status == 415 && err["error"]["code"].is_string(), "text/plain submit: {status} {err}");
        let bare = server.req(reqwest::Method::POST, "/v1/runs").body(body.clone());
        let (status, _) = server.send(bare).await?;
        ensure!(status == 415, "a submit without a content type: {status}");
        let (_, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "mode": "wait" } })).await?;
        let id = run["id"].as_i64().unwrap();
        let form = server.req(reqwest::Method::POST, &format!("/v1/runs/{id}/cancel")).header("content-type", "application/x-www-form-urlencoded");
        let (status, _) = server.send(form).await?;
        ensure!(status == 415, "a form POST to cancel: {status}");
        ensure!(db.store.get_run(id).await?.status != leasehold::store::RunStatus::Cancelled);
        // The page's own name in the Host header.
        let port = server.base.rsplit(':').next().unwrap_or_default().to_string();
        for host in [format!("rebind.example:{port}"), "rebind.example".to_string()] {
            let rebound = server.req(reqwest::Method::GET, "/v1/runs").header("host", host.clone());
            let (status, err) = server.send(rebound).await?;
            ensure!(status == 421 && err["error"]["code"].is_string(), "Host {host}: {status} {err}");
        }
        for host in [format!("localhost:{port}"), format!("127.0.0.1:{port}")] {
            let (status, _) = server.send(server.req(reqwest::Method::GET, "/v1/runs").header("host", host.clone())).await?;
            ensure!(status == 200, "Host {host}: {status}");
        }
        // No CORS: a preflight gets no permission.
        let preflight = server
            .req(reqwest::Method::OPTIONS, "/v1/runs")
            .header("origin", "https://evil.example")
            .header("access-control-request-method", "POST")
            .send()
            .await?;
        ensure!(preflight.headers().get("access-control-allow-origin").is_none(), "{:?}", preflight.headers());
        server.stop().await;
        Ok(())
    }

    async fn an_event_stream_is_woken_in_process_without_polling(db) {
        // Streams poll the database only for other hosts' events, and
        // slowly (here: never, within the test): this host's writes must
        // wake them at once.
        let server = Server::start_with(db, None, true, |c| c.stream_poll = Duration::from_secs(3600)).await?;
        let (status, body) = server.put_plugin("testkit", plugins::rust_plugin("testkit")?).await?;
        ensure!(status == 201, "{body}");
        // The turn emits, then waits for its input.
        let ops = json!([{ "op": "emit", "text": "hi" }, { "op": "wait", "prompt": "name?" }]);
        let (_, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "mode": "script", "ops": ops } })).await?;
        let thread = run["thread_id"].as_str().unwrap().to_string();
        let id = run["id"].as_i64().unwrap();
        // The input goes in once the stream has read the emit: only a
        // wake-up can then bring it the answer.
        let read_some = tokio::sync::Notify::new();
        let waiting = async {
            server.wait_status(id, "waiting_input").await?;
            read_some.notified().await;
            let (status, _) = server.post(&format!("/v1/runs/{id}/input"), json!({ "input": "Ada" })).await?;
            ensure!(status == 200);
            Ok::<_, anyhow::Error>(())
        };
        let path = format!("/v1/threads/{thread}/events");
        let reading = server.read_sse(&path, None, |e| {
            read_some.notify_one();
            e["kind"] == "message"
        });
        let (events, ()) = tokio::try_join!(reading, waiting)?;
        ensure!(events.last().is_some_and(|e| e["payload"]["output"].as_str().is_some_and(|o| o.contains("Ada"))), "{events:?}");
        server.stop().await;
        Ok(())
    }

    async fn list_ledger_and_event_pages_are_capped_by_bytes(db) {
        let server = Server::start_with(db, None, false, |_| {}).await?;
        let s = &db.store;
        let big = "x".repeat(200 << 10);
        let mut new = leasehold::store::NewRun::new("p", serde_json::to_string(&big)?);
        new.thread_id = Some("big".into());
        let mut ids = Vec::new();
        for _ in 0..12 {
            ids.push(s.create_run(&new).await?.0.id);
        }
        let claimed = s.claim("w", Duration::from_secs(30)).await?.unwrap();
        for i in 0..12 {
            s.emit(&claimed.lease, &big).await?;
            let call = leasehold::store::EffectCall { seq: i, name: "clock".into(), request_hash: "h".into(), request: String::new(), emit_pos: 0 };
            s.local_effect(&claimed.lease, &call, &leasehold::store::LocalOp::Record { value: big.clone() }).await?;
        }
        let cap = 2 << 20;
        let size = |v: &Value| v.to_string().len();
        let (status, list) = server.get("/v1/runs?limit=1000").await?;
        let runs = list["runs"].as_array().map_or(0, Vec::len);
        ensure!(status == 200 && size(&list) < cap && (1..12).contains(&runs) && list["next_cursor"].is_i64(), "runs: {runs}, {} bytes", size(&list));
        let (status, ledger) = server.get(&format!("/v1/runs/{}/effects", claimed.run.id)).await?;
        let rows = ledger["effects"].as_array().map_or(0, Vec::len);
        ensure!(status == 200 && size(&ledger) < cap && (1..12).contains(&rows) && ledger["next_after"].is_i64(), "effects: {rows}, {} bytes", size(&ledger));
        let (status, events) = server.get("/v1/threads/big/events?limit=10000").await?;
        let n = events["events"].as_array().map_or(0, Vec::len);
        ensure!(status == 200 && size(&events) < cap && (1..24).contains(&n), "events: {n}, {} bytes", size(&events));
        // Paging on gets the rest.
        let mut seen = 0;
        let mut cursor = String::new();
        loop {
            let (_, page) = server.get(&format!("/v1/runs?limit=1000{cursor}")).await?;
            seen += page["runs"].as_array().map_or(0, Vec::len);
            match page["next_cursor"].as_i64() {
                Some(c) => cursor = format!("&cursor={c}"),
                None => break,
            }
        }
        ensure!(seen == 12, "paged {seen} runs of 12");
        server.stop().await;
        Ok(())
    }
}

both! {
    async fn event_streams_past_the_cap_are_refused_with_retry_after(db) {
        let server = Server::start_with(db, None, false, |c| c.max_streams = 1).await?;
        let open = |thread: &str| server.req(reqwest::Method::GET, &format!("/v1/threads/{thread}/events")).header("Accept", "text/event-stream").send();
        let first = open("a").await?;
        ensure!(first.status() == 200, "{}", first.status());
        let second = open("b").await?;
        ensure!(second.status() == 503 && second.headers().get("retry-after").is_some(), "{} {:?}", second.status(), second.headers());
        let body: Value = second.json().await?;
        ensure!(body["error"]["code"] == "busy", "{body}");
        drop(first);
        // The stream's slot is given back once it notices its reader left.
        let last = std::cell::RefCell::new(String::new());
        eventually_some(Duration::from_secs(20), async || Ok(format!("the slot was never given back: {}", last.borrow())), async || {
            let again = open("c").await?.status();
            *last.borrow_mut() = again.to_string();
            Ok((again == 200).then_some(()))
        })
        .await?;
        server.stop().await;
        Ok(())
    }

    async fn uploads_past_the_cap_are_refused_with_retry_after(db) {
        let server = Server::start_with(db, None, false, |c| c.max_uploads = 1).await?;
        // An upload whose body never ends holds the one slot. It may itself
        // be refused, if it reaches the host while one of the uploads below
        // holds the slot: then it is started again.
        let start_slow = || {
            let (tx, rx) = tokio::sync::mpsc::channel::<Result<Vec<u8>, std::io::Error>>(1);
            tx.try_send(Ok(b"\0asm".to_vec())).expect("an empty channel");
            let stream = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|c| (c, rx)) });
            let slow = server.req(reqwest::Method::PUT, "/v1/plugins/slow").body(reqwest::Body::wrap_stream(stream)).send();
            (tx, tokio::spawn(slow))
        };
        let (mut tx, mut slow) = start_slow();
        let last = std::cell::RefCell::new(String::new());
        eventually_some(Duration::from_secs(20), async || Ok(format!("a second upload was not refused: {}", last.borrow())), async || {
            if slow.is_finished() {
                (tx, slow) = start_slow();
            }
            let (status, body) = server.put_plugin("other", plugins::rust_plugin("testkit")?).await?;
            if status == 503 {
                ensure!(body["error"]["code"] == "busy", "{body}");
                return Ok(Some(()));
            }
            *last.borrow_mut() = format!("{status} {body}");
            Ok(None)
        })
        .await?;
        drop(tx);
        let _ = slow.await;
        let (status, body) = server.put_plugin("other", plugins::rust_plugin("testkit")?).await?;
        ensure!(status == 201, "{status} {body}");
        server.stop().await;
        Ok(())
    }

    async fn metrics_gauges_come_from_a_cache_and_counters_stay_live(db) {
        let server = Server::start_with(db, None, false, |c| c.metrics_ttl = Duration::from_secs(3600)).await?;
        let scrape = async || -> Result<String> { Ok(server.req(reqwest::Method::GET, "/metrics").send().await?.text().await?) };
        let value = |text: &str, name: &str| -> Option<f64> {
            text.lines().find_map(|l| l.strip_prefix(name)?.strip_prefix(' ')?.parse().ok())
        };
        let first = scrape().await?;
        db.store.create_run(&leasehold::store::NewRun::new("p", "{}")).await?;
        let second = scrape().await?;
        let queued = r#"leasehold_runs{status="queued"}"#;
        ensure!(value(&first, queued) == Some(0.0) && value(&second, queued) == Some(0.0), "the gauge was read again:\n{second}");
        let requests = "leasehold_http_requests_total";
        ensure!(value(&second, requests) > value(&first, requests), "counters are live");
        server.stop().await;
        Ok(())
    }
}

#[test]
fn debug_output_never_shows_a_secret() {
    let api = ApiConfig { token: Some("s3cret-token".into()), ..ApiConfig::default() };
    let shown = format!("{api:?}");
    assert!(!shown.contains("s3cret-token"), "{shown}");
    let mut model = leasehold::effects::model::ModelConfig::new("http://127.0.0.1:1/v1");
    model.api_key = Some("sk-s3cret".into());
    let shown = format!("{model:?}");
    assert!(!shown.contains("sk-s3cret"), "{shown}");
}

/// A core module: valid Wasm, but not a component.
fn wat_core() -> Vec<u8> {
    b"\0asm\x01\0\0\0".to_vec()
}

/// A small deterministic generator (xorshift), so a failing case replays
/// from its seed.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: u64) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0 % n.max(1)
    }
}

both! {
    async fn reruns_past_the_replay_cap_are_refused_with_retry_after(db) {
        let server = Server::start_with(db, None, true, |c| c.max_replays = 1).await?;
        let (status, _) = server.put_plugin("testkit", plugins::rust_plugin("testkit")?).await?;
        ensure!(status == 201, "{status}");
        // Each replay of this prefix spins a while, so the reruns overlap.
        let (_, run) = server.post("/v1/runs", json!({ "plugin": "testkit", "input": { "steps": 2, "spin": 1u64 << 28 } })).await?;
        let id = run["id"].as_i64().context("id")?;
        server.wait_status(id, "completed").await?;
        let path = format!("/v1/runs/{id}/rerun");
        let reruns = (0..4).map(|_| server.post(&path, json!({ "from_seq": 2 })));
        let answers = futures::future::join_all(reruns).await;
        let statuses: Vec<u16> = answers.iter().map(|a| a.as_ref().map_or(0, |(s, _)| *s)).collect();
        ensure!(statuses.contains(&201), "{statuses:?}");
        let busy = answers.iter().flatten().find(|(s, _)| *s == 503);
        ensure!(busy.is_some_and(|(_, b)| b["error"]["code"] == "busy"), "no rerun past the cap was refused: {statuses:?}");
        server.stop().await;
        Ok(())
    }
}
