//! Named waits (`leasehold:turn/waits@0.2.0`, docs/concepts.md): input
//! delivered to a run and a name waits in its inbox until the turn's wait
//! takes it; a deadline resumes the wait with a timeout, once; an answer
//! link delivers once without the API token. Every test runs on both
//! backends, with the `approval` example plugin.

use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::executor::{Executor, ExecutorConfig, SegmentOutcome};
use leasehold::plugins::PluginSettings;
use leasehold::store::{NewRun, RunStatus, StoreError};
use serde_json::{Value, json};

use crate::harness::{TestDb, both, eventually};
use crate::plugins;
use crate::sink::Sink;

/// Registers `approval` (reaching `http_allow`) and returns a host maker.
async fn hosts(db: &TestDb, http_allow: Vec<String>, answer_base: Option<String>) -> Result<impl Fn(&str) -> Executor + use<>> {
    let runtime = plugins::runtime()?;
    let settings = PluginSettings { http_allow, ..PluginSettings::default() };
    leasehold::plugins::register(&db.store, &runtime, "approval", plugins::rust_plugin("approval")?, settings).await?;
    let store = db.store.clone();
    Ok(move |owner: &str| {
        let config = ExecutorConfig {
            answer_base: answer_base.clone().map(Into::into),
            ..crate::harness::worker(owner)
        };
        Executor::new(store.clone(), runtime.clone(), config)
    })
}

async fn submit(db: &TestDb, input: Value) -> Result<i64> {
    Ok(db.store.create_run(&NewRun::new("approval", input.to_string())).await?.0.id)
}

async fn ledger_names(db: &TestDb, run: i64) -> Result<Vec<String>> {
    Ok(db.store.effects(run).await?.into_iter().map(|r| r.name).collect())
}

both! {
    async fn input_delivered_before_the_wait_to_its_name_is_taken_and_other_names_are_left(db) {
        let host = hosts(db, vec![], None).await?;
        let id = submit(db, json!({ "sleep_ms": 400 })).await?;
        // The turn sleeps first: input arrives before it reaches its wait.
        let first = host("host-a").run_once().await?;
        ensure!(first == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{first:?}");
        db.store.deliver_named(id, "approval", "yes").await?;
        db.store.deliver_named(id, "other", "not this").await?;
        eventually("the run never completed", async || {
            if db.store.get_run(id).await?.status == RunStatus::Completed {
                return Ok(true);
            }
            host("host-a").drain().await?;
            Ok(false)
        })
        .await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some(r#"{"input":"yes"}"#), "output {:?}", run.output);
        // Suspended once, for the sleep: the wait took its input at once.
        ensure!(run.fence == 2, "fence {}", run.fence);
        let left: Vec<String> = sqlx::query_scalar("SELECT name FROM inbox WHERE run_id = $1").bind(id).fetch_all(db.store.pool()).await?;
        ensure!(left == vec!["other".to_string()], "inbox holds {left:?}");
        Ok(())
    }

    async fn a_named_wait_holds_no_worker_until_its_input_arrives_and_a_second_delivery_is_refused(db) {
        let host = hosts(db, vec![], None).await?;
        let id = submit(db, json!({ "prompt": "ship it?" })).await?;
        let first = host("host-a").run_once().await?;
        ensure!(first == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{first:?}");
        let run = db.store.get_run(id).await?;
        ensure!(run.waiting_for.as_deref() == Some("input:approval") && run.lease_owner.is_none(), "{:?} {:?}", run.waiting_for, run.lease_owner);
        ensure!(host("host-a").run_once().await?.is_none(), "a waiting run was claimed");
        db.store.deliver_named(id, "approval", "a").await?;
        match db.store.deliver_named(id, "approval", "b").await {
            Err(StoreError::Conflict { message, .. }) => ensure!(message.contains("not been taken"), "{message}"),
            other => anyhow::bail!("a second delivery to one name: {other:?}"),
        }
        host("host-a").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some(r#"{"input":"a"}"#), "output {:?}", run.output);
        match db.store.deliver_named(id, "approval", "c").await {
            Err(StoreError::Conflict { message, .. }) => ensure!(message.contains("finished"), "{message}"),
            other => anyhow::bail!("a delivery to a finished run: {other:?}"),
        }
        Ok(())
    }

    async fn a_deadline_resumes_the_wait_with_a_timeout_once_across_a_death(db) {
        let host = hosts(db, vec![], None).await?;
        // After its wait the turn computes for a while: host A dies there,
        // after the timeout is recorded.
        let id = submit(db, json!({ "timeout_ms": 300, "spin": 1u64 << 28 })).await?;
        let first = host("host-a").run_once().await?;
        ensure!(first == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{first:?}");
        let deadline = db.store.get_run(id).await?.not_before;
        eventually("the database's clock never reached the wait's deadline", async || Ok(db.store.now_ms().await? >= deadline)).await?;
        // Killed once the timeout is recorded.
        crate::harness::kill_when(db, host("host-a"), id, async || Ok(ledger_names(db, id).await?.contains(&"wait".to_string()))).await?;
        // The dead segment left the run its deadline: the next host
        // replays the timeout against the same instant.
        let left = db.store.get_run(id).await?;
        ensure!(left.status != RunStatus::Completed && left.not_before == deadline, "the deadline moved: {deadline} -> {left:?}");
        host("host-b").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some(r#"{"timeout":true}"#), "output {:?}", run.output);
        ensure!(ledger_names(db, id).await? == ["wait.deadline", "wait"], "ledger {:?}", ledger_names(db, id).await?);
        Ok(())
    }

    async fn a_run_past_its_wait_no_longer_waits_on_its_name(db) {
        let host = hosts(db, vec![], None).await?;
        // The wait times out; the turn then sleeps a minute.
        let id = submit(db, json!({ "timeout_ms": 200, "sleep_after_ms": 60_000 })).await?;
        host("host-a").run_once().await?;
        let deadline = db.store.get_run(id).await?.not_before;
        eventually("the database's clock never reached the wait's deadline", async || Ok(db.store.now_ms().await? >= deadline)).await?;
        let second = host("host-a").run_once().await?;
        ensure!(second == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{second:?}");
        let asleep = db.store.get_run(id).await?;
        ensure!(asleep.waiting_for.is_none(), "a sleeping run shows waiting_for {:?}", asleep.waiting_for);
        // Input to the name it no longer waits on lands in the inbox and
        // does not wake the sleep.
        db.store.deliver_named(id, "approval", "late").await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.not_before == asleep.not_before, "the delivery moved not_before from {} to {}", asleep.not_before, run.not_before);
        Ok(())
    }

    async fn an_answer_link_delivers_once_without_the_api_token_and_then_410s(db) {
        let notify = Sink::start().await?;
        // The API, served here, with a token the link must not need.
        let rt = plugins::runtime()?;
        let config = leasehold::api::ApiConfig { token: Some("secret-token".into()), ..leasehold::api::ApiConfig::default() };
        let server = crate::harness::Server::on(db, rt, config).await?;
        let base = server.base.clone();
        let host = hosts(db, vec![notify.allow()], Some(base.clone())).await?;
        let id = submit(db, json!({ "notify_url": notify.url, "prompt": "Ship <v2> & tell \"ops\"?" })).await?;
        let first = host("host-a").run_once().await?;
        ensure!(first == Some((id, SegmentOutcome::Suspended(RunStatus::Queued))), "{first:?}: {:?}", db.store.get_run(id).await?.error);
        let hits = notify.hits();
        ensure!(hits.len() == 1, "{} notifications", hits.len());
        let body: Value = serde_json::from_str(&hits[0].body)?;
        let link = body["link"].as_str().context("no link")?.to_string();
        ensure!(link.starts_with(&format!("{base}/v1/answers/")), "link {link}");
        let token = link.rsplit('/').next().unwrap_or_default();
        let stored: Vec<String> = sqlx::query_scalar("SELECT token_hash FROM answer_links").fetch_all(db.store.pool()).await?;
        ensure!(stored.len() == 1 && stored[0] != token, "the token itself is stored");
        let http = reqwest::Client::new();
        // Opening the link (as a mail scanner does) shows a form and uses nothing.
        let page = http.get(&link).send().await?;
        ensure!(page.status() == 200, "the link's page: {}", page.status());
        let html = page.text().await?;
        ensure!(html.contains("answer-form"), "the link's page has no form");
        ensure!(html.contains(r#"<blockquote id="answer-prompt" class="prompt" data-source="plugin">Ship &lt;v2&gt; &amp; tell &quot;ops&quot;?</blockquote>"#), "the page shows no escaped prompt: {html}");
        ensure!(html.contains("The plugin <code>approval</code> asks"), "the prompt is not marked as the plugin's: {html}");
        let page = http.get(&link).send().await?;
        ensure!(page.headers().get("cache-control").and_then(|v| v.to_str().ok()) == Some("no-store"), "{:?}", page.headers().get("cache-control"));
        let answer = |input: &str| http.post(&link).json(&json!({ "input": input })).send();
        let r = answer("ok").await?;
        ensure!(r.status() == 200, "first use: {} {}", r.status(), r.text().await?);
        // Its wait has its input: the page no longer shows the prompt.
        let html = http.get(&link).send().await?.text().await?;
        ensure!(!html.contains("answer-prompt"), "the page still shows the prompt of a wait that has its answer: {html}");
        let r = answer("again").await?;
        ensure!(r.status() == 410, "second use: {} {}", r.status(), r.text().await?);
        let r = http.post(format!("{base}/v1/answers/{}", "0".repeat(64))).json(&json!({ "input": "x" })).send().await?;
        ensure!(r.status() == 410, "a made-up link: {}", r.status());
        host("host-a").drain().await?;
        let run = db.store.get_run(id).await?;
        ensure!(run.output.as_deref() == Some(r#"{"input":"ok"}"#), "output {:?}: {:?}", run.output, run.error);
        // A link whose run was cancelled shows no prompt: its wait is over.
        let gone = submit(db, json!({ "notify_url": notify.url, "prompt": "Still there?" })).await?;
        host("host-a").run_once().await?;
        let hits = notify.hits();
        let body: Value = serde_json::from_str(&hits.last().context("a second notification")?.body)?;
        let second = body["link"].as_str().context("no link")?.to_string();
        db.store.cancel(gone).await?;
        let html = http.get(&second).send().await?.text().await?;
        ensure!(!html.contains("answer-prompt"), "a cancelled run's link still shows its prompt: {html}");
        // The named delivery through the API, which needs the token.
        let r = http.post(format!("{base}/v1/runs/{id}/input")).json(&json!({ "name": "approval", "input": "x" })).send().await?;
        ensure!(r.status() == 401, "without the token: {}", r.status());
        let r = http
            .post(format!("{base}/v1/runs/{id}/input"))
            .bearer_auth("secret-token")
            .json(&json!({ "name": "Bad Name", "input": "x" }))
            .send()
            .await?;
        ensure!(r.status() == 400, "a bad name: {}", r.status());
        server.stop().await;
        Ok(())
    }
}

both! {
    async fn answer_links_past_the_hosts_rate_are_refused_with_429(db) {
        let rt = plugins::runtime()?;
        let config = leasehold::api::ApiConfig { answers_per_second: 1, answers_burst: 3, ..leasehold::api::ApiConfig::default() };
        let server = crate::harness::Server::on(db, rt, config).await?;
        let base = server.base.clone();
        let http = reqwest::Client::new();
        let made_up = format!("{base}/v1/answers/{}", "0".repeat(64));
        for i in 0..3 {
            let r = http.post(&made_up).json(&json!({ "input": "x" })).send().await?;
            ensure!(r.status() == 410, "request {i}: {}", r.status());
        }
        let r = http.post(&made_up).json(&json!({ "input": "x" })).send().await?;
        ensure!(r.status() == 429, "past the burst: {}", r.status());
        let wait: u64 = r.headers().get("retry-after").and_then(|v| v.to_str().ok()).and_then(|v| v.parse().ok()).unwrap_or(0);
        let body: Value = r.json().await?;
        ensure!(wait >= 1 && body["error"]["code"] == "rate_limited", "retry-after {wait}, {body}");
        server.stop().await;
        Ok(())
    }
}

/// A made-up answer token is refused from a read: it never waits for
/// SQLite's one writer.
#[tokio::test]
async fn a_made_up_answer_token_never_waits_for_the_writer() -> Result<()> {
    crate::harness::run_on(leasehold::store::Backend::Sqlite, async |db| {
        let rt = plugins::runtime()?;
        let server = crate::harness::Server::on(db, rt, leasehold::api::ApiConfig::default()).await?;
        let base = server.base.clone();
        let held = db.store.writer().acquire().await?;
        let r = tokio::time::timeout(
            Duration::from_secs(2),
            reqwest::Client::new().post(format!("{base}/v1/answers/{}", "0".repeat(64))).json(&json!({ "input": "x" })).send(),
        )
        .await;
        drop(held);
        let status = r.map_err(|_| anyhow::anyhow!("a made-up token waited for the writer"))??.status();
        ensure!(status == 410, "{status}");
        server.stop().await;
        Ok(())
    })
    .await
}

both! {
    async fn a_retried_named_delivery_is_delivered_once(db) {
        use leasehold::store::Delivery;
        let host = hosts(db, vec![], None).await?;
        // Waits on `approval`, then sleeps a minute.
        let id = submit(db, json!({ "sleep_after_ms": 60_000 })).await?;
        host("host-a").run_once().await?;
        let s = &db.store;
        let (_, first) = s.deliver_once(id, Some("approval"), "yes", "d1").await?;
        let (_, again) = s.deliver_once(id, Some("approval"), "yes", "d1").await?;
        ensure!(first == Delivery::New && again == Delivery::Repeat, "{first:?} then {again:?}");
        // The wait takes it; the run sleeps on. A late retry delivers nothing.
        host("host-a").drain().await?;
        let (_, late) = s.deliver_once(id, Some("approval"), "yes", "d1").await?;
        ensure!(late == Delivery::Repeat, "{late:?}");
        let inbox: i64 = sqlx::query_scalar("SELECT COUNT(*) FROM inbox WHERE run_id = $1").bind(id).fetch_one(s.pool()).await?;
        ensure!(inbox == 0, "a retried delivery landed again: {inbox} in the inbox");
        let (_, other) = s.deliver_once(id, Some("approval"), "no", "d1").await?;
        ensure!(other == Delivery::Mismatch, "{other:?}");
        let (_, fresh) = s.deliver_once(id, Some("approval"), "later", "d2").await?;
        ensure!(fresh == Delivery::New, "{fresh:?}");
        let inputs = s.run_events(id).await?.into_iter().filter(|e| e.kind == "input").count();
        ensure!(inputs == 2, "{inputs} input events for two deliveries");
        Ok(())
    }
}
