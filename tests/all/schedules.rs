//! Schedules (docs/operations.md, "Schedules"): each scheduled time is
//! recorded once, as a run or a skip with its reason, however many hosts
//! tick and whoever dies; the overlap policies; the catch-up window; the
//! daylight-saving rule; the API. Both backends.

use std::collections::BTreeMap;
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use leasehold::schedules::Spec;
use leasehold::schedules::ticker::{self, TickerConfig};
use leasehold::store::ticks::Outcome;
use leasehold::store::{Overlap, PluginSettings, RunStatus, Schedule, Store, Tick};
use serde_json::{Value, json};

use crate::harness::{TestDb, both};
use crate::serve_proc::{ServeArgs, ServeProc};

async fn noop_plugin(store: &Store) -> Result<()> {
    store.put_plugin("noop", "sha256:noop", b"not run here", &PluginSettings::default()).await?;
    Ok(())
}

/// A schedule of plugin `noop` every `every_ms`, its first tick the
/// first time after `from`.
fn every(id: &str, every_ms: i64, overlap: Overlap, from: i64) -> Schedule {
    let mut s = Schedule {
        id: id.into(),
        plugin: "noop".into(),
        input: "{}".into(),
        cron: None,
        interval_ms: Some(every_ms),
        time_zone: "UTC".into(),
        overlap,
        catchup_window_ms: 3_600_000,
        jitter_ms: 0,
        priority: 0,
        concurrency_key: None,
        max_attempts: 3,
        budget_tokens: None,
        budget_usd_nanos: None,
        paused: false,
        note: None,
        next_at: None,
        version: 0,
        created_at: 0,
        updated_at: 0,
    };
    s.next_at = Spec::of(&s).unwrap().next_after(from);
    s
}

async fn all_ticks(store: &Store, id: &str) -> Result<Vec<Tick>> {
    let mut t = store.ticks(id, i64::MAX, 100_000).await?;
    t.reverse();
    Ok(t)
}

/// Runs `schedule_id` started: scheduled time -> (run id, status).
async fn runs_of(store: &Store, id: &str) -> Result<BTreeMap<i64, (i64, String)>> {
    let rows: Vec<(i64, i64, String)> = sqlx::query_as("SELECT scheduled_at, id, status FROM runs WHERE schedule_id = $1")
        .bind(id)
        .fetch_all(store.pool())
        .await?;
    Ok(rows.into_iter().map(|(at, id, st)| (at, (id, st))).collect())
}

/// Every tick of `id` is one scheduled time, in a row with no gap from
/// the first to the schedule's `next_at`; each started tick's run names it
/// and its time; and no run of the schedule lacks a tick.
async fn every_time_once(store: &Store, id: &str, every_ms: i64) -> Result<Vec<Tick>> {
    let ticks = all_ticks(store, id).await?;
    let s = store.schedule(id).await?.expect("the schedule");
    ensure!(!ticks.is_empty(), "no ticks at all");
    let first = ticks[0].scheduled_at;
    let expected: Vec<i64> = (0..).map(|i| first + i * every_ms).take_while(|t| *t < s.next_at.unwrap()).collect();
    // A run of missed times is one record: each of its times counts.
    let got: Vec<i64> = ticks
        .iter()
        .flat_map(|t| (0..t.times).map(move |i| t.scheduled_at + i * every_ms))
        .collect();
    for t in ticks.iter().filter(|t| t.times > 1) {
        ensure!(t.through_at == Some(t.scheduled_at + (t.times - 1) * every_ms), "a span's end: {t:?}");
    }
    ensure!(got == expected, "ticks {got:?}, expected every time from {first} to {:?}", s.next_at);
    let runs = runs_of(store, id).await?;
    let started: BTreeMap<i64, i64> = ticks.iter().filter(|t| t.outcome == Outcome::Started).map(|t| (t.scheduled_at, t.run_id.unwrap())).collect();
    ensure!(runs.len() == started.len(), "{} runs for {} started ticks", runs.len(), started.len());
    for (at, run) in &started {
        ensure!(runs.get(at).map(|r| r.0) == Some(*run), "tick {at} names run {run}, runs: {:?}", runs.get(at));
    }
    for t in ticks.iter().filter(|t| t.outcome == Outcome::Skipped) {
        ensure!(t.reason.is_some() && t.run_id.is_none(), "a skip without a reason: {t:?}");
    }
    Ok(ticks)
}

both! {
    async fn three_hosts_sigkilled_and_restarted_record_each_second_once(db) {
        // Three `leasehold serve` processes on one database, one schedule of
        // every second; every 0.7 to 1.6 s one host is SIGKILLed (whatever
        // it was doing: mid-tick as likely as not), and every 7th time all
        // three for 1.5 s; the dead come back. For 20 s, or
        // LEASEHOLD_SCHEDULES_KILL_SECONDS (the long mode: 60 or more).
        let seconds: u64 = match std::env::var("LEASEHOLD_SCHEDULES_KILL_SECONDS") {
            Ok(v) => v.parse().context("LEASEHOLD_SCHEDULES_KILL_SECONDS: whole seconds")?,
            Err(_) => 20,
        };
        leasehold::effects::http::install_tls();
        let dir = tempfile::tempdir()?;
        std::fs::write(dir.path().join("testkit.wasm"), crate::plugins::rust_plugin("testkit")?)?;
        let http = crate::serve_proc::client(reqwest::Client::builder())?;
        let args: Vec<ServeArgs> = (0..3).map(|i| ServeArgs::new(db.url(), dir.path(), format!("host-{i}"))).collect::<Result<_>>()?;
        let mut hosts: Vec<Option<ServeProc>> = Vec::new();
        for a in &args {
            let host = ServeProc::spawn(a)?;
            host.wait_healthy(&http, Duration::from_secs(60)).await?;
            hosts.push(Some(host));
        }
        let body = json!({ "id": "each-second", "plugin": "testkit", "input": { "steps": 1 }, "interval": "1s", "overlap": "allow_all" });
        let r = http.post(format!("{}/v1/schedules", hosts[0].as_ref().expect("up").base)).json(&body).send().await?;
        ensure!(r.status() == 201, "{}", r.text().await?);
        let until = std::time::Instant::now() + Duration::from_secs(seconds);
        let (mut kills, mut i) = (0, 0usize);
        while std::time::Instant::now() < until {
            tokio::time::sleep(Duration::from_millis(700 + rand::random::<u64>() % 900)).await;
            i += 1;
            if hosts[rand::random::<u64>() as usize % 3].take().is_some() {
                kills += 1; // dropped: SIGKILL
            }
            if i % 7 == 0 {
                kills += hosts.iter_mut().filter_map(Option::take).count();
                tokio::time::sleep(Duration::from_millis(1500)).await;
            }
            for (slot, a) in hosts.iter_mut().zip(&args) {
                if slot.is_none() && (rand::random::<bool>() || i % 7 == 0) {
                    *slot = Some(ServeProc::spawn(a)?);
                }
            }
        }
        drop(hosts);
        // A commit a killed host had sent lands before we look.
        crate::harness::until_quiet(db).await?;
        ensure!(kills as u64 >= seconds / 3, "only {kills} kills in {seconds} s");
        let ticks = every_time_once(&db.store, "each-second", 1000).await?;
        ensure!(ticks.len() as u64 + 5 >= seconds, "{} ticks in {seconds} s", ticks.len());
        ensure!(ticks.iter().all(|t| t.outcome == Outcome::Started), "a tick of an allow_all schedule did not start: {ticks:?}");
        for a in &args {
            let log = std::fs::read_to_string(&a.log).unwrap_or_default();
            ensure!(!log.contains("panicked"), "{} panicked:\n{log}", a.owner);
        }
        Ok(())
    }

    async fn a_jittered_schedules_runs_wait_a_share_of_the_jitter_the_same_on_every_host(db) {
        noop_plugin(&db.store).await?;
        let t0 = 1_800_000_000_000;
        let mut s = every("jittered", 1000, Overlap::AllowAll, t0);
        s.jitter_ms = 10_000;
        db.store.create_schedule(&s).await?;
        let config = TickerConfig::default();
        for k in 1..=20 {
            ticker::tick_at(&db.store, &config, t0 + 1000 * k).await?;
        }
        let ticks = all_ticks(&db.store, "jittered").await?;
        ensure!(ticks.len() == 20, "{} ticks", ticks.len());
        let mut waits = std::collections::BTreeSet::new();
        for t in &ticks {
            let run = db.store.get_run(t.run_id.context("a started tick's run")?).await?;
            // Each run waits 0 to 10 s past its start, by a hash of the
            // schedule and the time: what any host would have chosen.
            let waited = run.not_before - run.created_at;
            let want = leasehold::store::ticks::jitter(&s, t.scheduled_at);
            ensure!(waited == want && (0..=10_000).contains(&waited), "the run for {} waits {waited} ms, not {want}", t.scheduled_at);
            waits.insert(waited);
        }
        ensure!(waits.len() > 10, "20 ticks spread over only {} waits: {waits:?}", waits.len());
        Ok(())
    }

    async fn overlap_policies_decide_a_tick_while_the_last_run_is_open(db) {
        noop_plugin(&db.store).await?;
        let t0 = 1_800_000_000_000;
        for o in [Overlap::Skip, Overlap::BufferOne, Overlap::AllowAll, Overlap::CancelOther] {
            db.store.create_schedule(&every(o.as_str(), 1000, o, t0)).await?;
        }
        let config = TickerConfig::default();
        // The first tick of each starts a run, which is still open (runs
        // take longer than the interval) at the second and third.
        ticker::tick_at(&db.store, &config, t0 + 1000).await?;
        ticker::tick_at(&db.store, &config, t0 + 2000).await?;
        ticker::tick_at(&db.store, &config, t0 + 3000).await?;
        let outcomes = |ticks: &[Tick]| ticks.iter().map(|t| (t.outcome, t.reason.clone())).collect::<Vec<_>>();

        let skip = all_ticks(&db.store, "skip").await?;
        let first = skip[0].run_id.unwrap();
        ensure!(outcomes(&skip) == vec![
            (Outcome::Started, None),
            (Outcome::Skipped, Some(format!("overlap: run {first} is still open"))),
            (Outcome::Skipped, Some(format!("overlap: run {first} is still open"))),
        ], "skip: {skip:?}");

        let all = all_ticks(&db.store, "allow_all").await?;
        ensure!(all.iter().all(|t| t.outcome == Outcome::Started) && all.len() == 3, "allow_all: {all:?}");
        ensure!(runs_of(&db.store, "allow_all").await?.values().all(|(_, st)| st == "queued"));

        let cancel = all_ticks(&db.store, "cancel_other").await?;
        let runs = runs_of(&db.store, "cancel_other").await?;
        let ids: Vec<i64> = cancel.iter().map(|t| t.run_id.unwrap()).collect();
        ensure!(cancel[1].reason == Some(format!("cancelled run {}", ids[0])), "{cancel:?}");
        ensure!(cancel[2].reason == Some(format!("cancelled run {}", ids[1])), "{cancel:?}");
        let statuses: Vec<&str> = runs.values().map(|(_, st)| st.as_str()).collect();
        ensure!(statuses == ["cancelled", "cancelled", "queued"], "cancel_other's runs: {statuses:?}");

        let buffer = all_ticks(&db.store, "buffer_one").await?;
        let a = buffer[0].run_id.unwrap();
        ensure!(outcomes(&buffer) == vec![
            (Outcome::Started, None),
            (Outcome::Buffered, None),
            (Outcome::Skipped, Some(format!("overlap: run {a} is still open and a tick is buffered already"))),
        ], "buffer_one: {buffer:?}");
        // The open run ends: the next pass starts the buffered tick, for
        // its own scheduled time.
        ticker::tick_at(&db.store, &config, t0 + 3500).await?;
        ensure!(all_ticks(&db.store, "buffer_one").await?[1].outcome == Outcome::Buffered, "released while the run is open");
        db.store.cancel(a).await?;
        let pass = ticker::tick_at(&db.store, &config, t0 + 3600).await?;
        ensure!(pass.started == 1, "{pass:?}");
        let buffer = all_ticks(&db.store, "buffer_one").await?;
        ensure!(buffer[1].outcome == Outcome::Started, "{buffer:?}");
        let b = buffer[1].run_id.unwrap();
        let run_b = db.store.get_run(b).await?;
        ensure!(run_b.schedule_id.as_deref() == Some("buffer_one") && run_b.scheduled_at == Some(t0 + 2000), "{run_b:?}");
        ensure!(run_b.status == RunStatus::Queued);
        // A tick that finds the open run ended before any pass started the
        // buffered one: the buffered one goes first, the new one waits.
        ticker::tick_at(&db.store, &config, t0 + 4000).await?;
        db.store.cancel(b).await?;
        ticker::tick_at(&db.store, &config, t0 + 5000).await?;
        let buffer = all_ticks(&db.store, "buffer_one").await?;
        ensure!(buffer.len() == 5 && buffer[3].outcome == Outcome::Started && buffer[4].outcome == Outcome::Buffered, "{buffer:?}");
        Ok(())
    }

    async fn a_schedule_whose_tick_fails_holds_up_no_other_and_is_tried_again(db) {
        noop_plugin(&db.store).await?;
        let t0 = 1_800_000_000_000;
        db.store.create_schedule(&every("broken", 1000, Overlap::AllowAll, t0 - 1000)).await?;
        db.store.create_schedule(&every("fine", 1000, Overlap::AllowAll, t0)).await?;
        // A row the API would refuse (a hand edit): its run cannot be written.
        sqlx::query("UPDATE schedules SET max_attempts = 0 WHERE id = 'broken'").execute(db.store.pool()).await?;
        let pass = ticker::tick_at(&db.store, &TickerConfig::default(), t0 + 1000).await?;
        ensure!(pass.failed == 1 && pass.started == 1, "{pass:?}");
        ensure!(all_ticks(&db.store, "broken").await?.is_empty());
        ensure!(db.store.schedule("broken").await?.unwrap().next_at == Some(t0), "the failed tick is still due");
        sqlx::query("UPDATE schedules SET max_attempts = 3 WHERE id = 'broken'").execute(db.store.pool()).await?;
        let pass = ticker::tick_at(&db.store, &TickerConfig::default(), t0 + 1000).await?;
        ensure!(pass.failed == 0 && pass.started == 2, "{pass:?}");
        Ok(())
    }

    async fn after_a_ten_second_outage_ticks_older_than_the_five_second_window_are_recorded_as_missed(db) {
        noop_plugin(&db.store).await?;
        let t0 = 1_800_000_000_000;
        let mut s = every("catch-up", 1000, Overlap::AllowAll, t0);
        s.catchup_window_ms = 5000;
        db.store.create_schedule(&s).await?;
        let config = TickerConfig::default();
        for k in 1..=3 {
            ticker::tick_at(&db.store, &config, t0 + k * 1000).await?;
        }
        // Down from t0+3s to t0+13s.
        let pass = ticker::tick_at(&db.store, &config, t0 + 13_000).await?;
        ensure!(pass.skipped == 4 && pass.started == 6, "{pass:?}");
        let ticks = every_time_once(&db.store, "catch-up", 1000).await?;
        let at = |k: i64| ticks.iter().find(|t| t.scheduled_at == t0 + k * 1000).unwrap();
        // The four missed times are one record.
        let missed = at(4);
        ensure!(missed.outcome == Outcome::Skipped && missed.times == 4 && missed.through_at == Some(t0 + 7000), "{missed:?}");
        ensure!(missed.reason.as_deref() == Some("missed: 9s late, past the catch-up window of 5s"), "{missed:?}");
        ensure!(ticks.len() == 3 + 1 + 6, "{} records", ticks.len());
        for k in (1..=3).chain(8..=13) {
            ensure!(at(k).outcome == Outcome::Started, "{:?}", at(k));
        }
        ensure!(db.store.schedule("catch-up").await?.unwrap().next_at == Some(t0 + 14_000));
        Ok(())
    }

    async fn a_day_of_downtime_is_one_record_and_the_schedule_catches_up_in_one_pass(db) {
        noop_plugin(&db.store).await?;
        let t0 = 1_800_000_000_000;
        let mut s = every("day", 1000, Overlap::AllowAll, t0);
        s.catchup_window_ms = 5000;
        db.store.create_schedule(&s).await?;
        let config = TickerConfig::default();
        ticker::tick_at(&db.store, &config, t0 + 1000).await?;
        let now = t0 + 86_400_000;
        let pass = ticker::tick_at(&db.store, &config, now).await?;
        ensure!(pass.skipped == 86_393 && pass.started == 6, "{pass:?}");
        let ticks = every_time_once(&db.store, "day", 1000).await?;
        ensure!(ticks.len() == 8, "{} records for a day of downtime", ticks.len());
        ensure!(db.store.schedule("day").await?.unwrap().next_at == Some(now + 1000));
        // A backfill of a time inside the run returns its one record.
        let s = db.store.schedule("day").await?.unwrap();
        let got = db.store.backfill(&s, &[t0 + 50_000, t0 + 60_000], Overlap::AllowAll).await?;
        ensure!(got.len() == 1 && got[0].times == 86_393, "{got:?}");
        Ok(())
    }

    async fn a_daily_0230_schedule_runs_once_a_day_across_both_daylight_saving_changes(db) {
        noop_plugin(&db.store).await?;
        let ms = |t: &str| t.parse::<jiff::Timestamp>().unwrap().as_millisecond();
        let mut s = every("berlin", 1000, Overlap::AllowAll, 0);
        (s.cron, s.interval_ms, s.time_zone) = (Some("30 2 * * *".into()), None, "Europe/Berlin".into());
        s.next_at = Spec::of(&s).unwrap().next_after(ms("2026-03-20T00:00:00Z"));
        db.store.create_schedule(&s).await?;
        let config = TickerConfig::default();
        // Each tick on time, from March to November.
        while let Some(next) = db.store.schedule("berlin").await?.unwrap().next_at.filter(|n| *n < ms("2026-11-05T00:00:00Z")) {
            ticker::tick_at(&db.store, &config, next).await?;
        }
        let ticks = every_time_once_daily(&db.store).await?;
        let berlin = jiff::tz::TimeZone::get("Europe/Berlin")?;
        let mut days = std::collections::BTreeSet::new();
        for t in &ticks {
            let local = jiff::Timestamp::from_millisecond(t.scheduled_at)?.to_zoned(berlin.clone());
            ensure!(days.insert(local.date()), "two ticks on {}", local.date());
            let time = (local.hour(), local.minute());
            // 02:30 every day but the one it does not exist: 03:30 then.
            if local.date() == jiff::civil::date(2026, 3, 29) {
                ensure!(time == (3, 30) && t.scheduled_at == ms("2026-03-29T03:30:00+02:00"), "{local}");
            } else {
                ensure!(time == (2, 30), "{local}");
            }
            ensure!(t.outcome == Outcome::Started, "{t:?}");
        }
        // On the day 02:30 happens twice, the first.
        ensure!(ticks.iter().any(|t| t.scheduled_at == ms("2026-10-25T02:30:00+02:00")));
        ensure!(!ticks.iter().any(|t| t.scheduled_at == ms("2026-10-25T02:30:00+01:00")));
        let first = jiff::civil::date(2026, 3, 20);
        let last = jiff::civil::date(2026, 11, 4);
        ensure!(days.len() as i32 == (last - first).get_days() + 1, "{} days ticked", days.len());
        Ok(())
    }

    async fn the_api_makes_changes_backfills_and_deletes_schedules_and_refuses_bad_ones(db) {
        noop_plugin(&db.store).await?;
        let (base, client, _stop) = crate::schedules::api(&db).await?;
        let post = |path: &str, body: Value| client.post(format!("{base}{path}")).json(&body).send();
        let r = post("/v1/schedules", json!({ "id": "hourly", "plugin": "noop", "input": {"n": 1}, "cron": "0 * * * *", "time_zone": "Europe/Berlin" })).await?;
        ensure!(r.status() == 201, "{}", r.text().await?);
        let made: Value = r.json().await?;
        ensure!(made["upcoming"].as_array().unwrap().len() == 5 && made["overlap"] == "skip" && made["catchup_window"] == "1h", "{made}");
        ensure!(made["input"] == json!({"n": 1}));
        for (body, status, says) in [
            (json!({ "plugin": "noop", "cron": "61 * * * *" }), 400, "out of range"),
            (json!({ "plugin": "noop", "cron": "0 0 30 2 *" }), 400, "matches no time"),
            (json!({ "plugin": "noop", "cron": "* * * * *", "time_zone": "Mars/Base" }), 400, "unknown time zone"),
            (json!({ "plugin": "noop", "cron": "* * * * *", "interval": "5m" }), 400, "not both"),
            (json!({ "plugin": "noop" }), 400, "give cron"),
            (json!({ "plugin": "noop", "interval": "500ms" }), 400, "at least 1s"),
            (json!({ "plugin": "noop", "interval": "5 minutes" }), 400, "units"),
            (json!({ "plugin": "noop", "interval": "5m", "overlap": "sometimes" }), 400, "unknown variant"),
            (json!({ "plugin": "nope", "interval": "5m" }), 404, "no plugin"),
            (json!({ "id": "bad id", "plugin": "noop", "interval": "5m" }), 400, "schedule id"),
            (json!({ "id": "hourly", "plugin": "noop", "interval": "5m" }), 409, "exists already"),
        ] {
            let r = post("/v1/schedules", body.clone()).await?;
            let code = r.status().as_u16();
            let text = r.text().await?;
            ensure!(code == status && text.contains(says), "{body} -> {code} {text}");
        }
        // Pause, resume, retime.
        let patch = |body: Value| client.patch(format!("{base}/v1/schedules/hourly")).json(&body).send();
        let paused: Value = patch(json!({ "paused": true, "note": "downstream is down" })).await?.json().await?;
        ensure!(paused["paused"] == true && paused["upcoming"] == json!([]) && paused["note"] == "downstream is down", "{paused}");
        let changed: Value = patch(json!({ "paused": false, "interval": "15m", "overlap": "buffer_one" })).await?.json().await?;
        ensure!(changed["cron"].is_null() && changed["interval"] == "15m" && changed["overlap"] == "buffer_one", "{changed}");
        let up = changed["upcoming"].as_array().unwrap();
        ensure!(up.len() == 5 && up.iter().all(|t| t.as_i64().unwrap() % 900_000 == 0), "{changed}");
        let r = patch(json!({ "jitter": "soon" })).await?;
        ensure!(r.status() == 400, "{}", r.text().await?);
        // Backfill the last hour: four quarter-hours, all started.
        let now = db.store.now_ms().await?;
        let r = post("/v1/schedules/hourly/backfill", json!({ "from": now - 3_600_000, "to": now, "overlap": "allow_all" })).await?;
        ensure!(r.status() == 200, "{}", r.text().await?);
        let filled: Value = r.json().await?;
        let ticks = filled["ticks"].as_array().unwrap();
        ensure!(ticks.len() == 4 && ticks.iter().all(|t| t["outcome"] == "started" && t["backfill"] == true), "{filled}");
        let run = db.store.get_run(ticks[0]["run_id"].as_i64().unwrap()).await?;
        ensure!(run.schedule_id.as_deref() == Some("hourly") && run.scheduled_at == ticks[0]["scheduled_at"].as_i64(), "{run:?}");
        ensure!(run.input == r#"{"n":1}"#, "{}", run.input);
        // Again: the same times, recorded once.
        let again: Value = post("/v1/schedules/hourly/backfill", json!({ "from": now - 3_600_000, "to": now })).await?.json().await?;
        ensure!(again["ticks"] == filled["ticks"], "{again}");
        ensure!(runs_of(&db.store, "hourly").await?.len() == 4);
        for (body, says) in [
            (json!({ "from": now, "to": now + 3_600_000 }), "in the future"),
            (json!({ "from": now, "to": now - 1 }), "after to"),
            (json!({ "from": "yesterday", "to": now }), "RFC 3339"),
        ] {
            let r = post("/v1/schedules/hourly/backfill", body.clone()).await?;
            let code = r.status().as_u16();
            let text = r.text().await?;
            ensure!(code == 400 && text.contains(says), "{body} -> {code} {text}");
        }
        let r = post("/v1/schedules/every-second/backfill", json!({ "from": 0, "to": now })).await?;
        ensure!(r.status() == 404, "{}", r.text().await?);
        // Show: the ticks with their runs' status.
        let shown: Value = client.get(format!("{base}/v1/schedules/hourly")).send().await?.json().await?;
        ensure!(shown["recent"].as_array().unwrap().len() == 4 && shown["recent"][0]["run_status"] == "queued", "{shown}");
        let page: Value = client.get(format!("{base}/v1/schedules/hourly/ticks?limit=3")).send().await?.json().await?;
        ensure!(page["ticks"].as_array().unwrap().len() == 3 && page["next"].is_i64(), "{page}");
        let list: Value = client.get(format!("{base}/v1/schedules")).send().await?.json().await?;
        ensure!(list["schedules"].as_array().unwrap().len() == 1, "{list}");
        // Delete: gone, its runs kept.
        ensure!(client.delete(format!("{base}/v1/schedules/hourly")).send().await?.status() == 204);
        ensure!(client.get(format!("{base}/v1/schedules/hourly")).send().await?.status() == 404);
        ensure!(runs_of(&db.store, "hourly").await?.len() == 4);
        Ok(())
    }
}

both! {
    async fn the_cli_makes_shows_backfills_pauses_and_removes_a_schedule_and_exits_non_zero_on_a_bad_one(db) {
        noop_plugin(&db.store).await?;
        let (base, _client, _stop) = api(&db).await?;
        let cli = |args: &[&str]| {
            let out = std::process::Command::new(env!("CARGO_BIN_EXE_leasehold"))
                .args(args)
                .args(["--server", &base, "--token", "unused"])
                .output()?;
            anyhow::Ok((out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned(), String::from_utf8_lossy(&out.stderr).into_owned()))
        };
        let (ok, out, err) = cli(&["schedules", "add", "noop", "--id", "cli", "--every", "1m", "--overlap", "allow_all", "--input", r#"{"a":1}"#])?;
        ensure!(ok && out.contains("cli") && out.contains("every 1m"), "{out}{err}");
        let (ok, out, err) = cli(&["schedules", "add", "noop", "--cron", "61 * * * *"])?;
        ensure!(!ok && err.contains("out of range"), "{out}{err}");
        let now = db.store.now_ms().await?;
        let (from, to) = ((now - 180_000).to_string(), now.to_string());
        let (ok, out, err) = cli(&["schedules", "backfill", "cli", &from, &to])?;
        ensure!(ok && out.matches("started").count() == 3, "{out}{err}");
        let (ok, out, err) = cli(&["schedules", "pause", "cli", "--note", "maintenance"])?;
        ensure!(ok && out.contains("paused"), "{out}{err}");
        let (ok, out, err) = cli(&["schedules", "show", "cli", "--json"])?;
        let shown: Value = serde_json::from_str(&out).map_err(|e| anyhow::anyhow!("{e}: {out}{err}"))?;
        ensure!(ok && shown["paused"] == true && shown["note"] == "maintenance" && shown["recent"].as_array().map(Vec::len) == Some(3), "{shown}");
        let (ok, out, err) = cli(&["schedules", "list"])?;
        ensure!(ok && out.contains("cli") && out.contains("paused"), "{out}{err}");
        let (ok, out, err) = cli(&["schedules", "rm", "cli"])?;
        ensure!(ok && out.contains("deleted"), "{out}{err}");
        let (ok, _, err) = cli(&["schedules", "show", "cli"])?;
        ensure!(!ok && err.contains("no schedule"), "{err}");
        Ok(())
    }
}

/// As [`every_time_once`] for the daily schedule `berlin` (whose times are
/// not evenly spaced): each started tick's run names it, no run lacks one.
async fn every_time_once_daily(store: &Store) -> Result<Vec<Tick>> {
    let ticks = all_ticks(store, "berlin").await?;
    let runs = runs_of(store, "berlin").await?;
    ensure!(runs.len() == ticks.len(), "{} runs for {} ticks", runs.len(), ticks.len());
    for t in &ticks {
        ensure!(runs.get(&t.scheduled_at).map(|r| r.0) == t.run_id, "{t:?}");
    }
    Ok(ticks)
}

/// The API on `db` (a fresh runtime), with its base URL and a client;
/// dropping the server stops it.
pub async fn api(db: &TestDb) -> Result<(String, reqwest::Client, crate::harness::Server)> {
    api_with(db, leasehold::api::ApiConfig::default()).await
}

/// [`api`] with `config`.
pub async fn api_with(db: &TestDb, config: leasehold::api::ApiConfig) -> Result<(String, reqwest::Client, crate::harness::Server)> {
    let server = crate::harness::Server::on(db, crate::plugins::runtime()?, config).await?;
    Ok((server.base.clone(), server.http.clone(), server))
}

both! {
    async fn a_backfill_after_retention_neither_fails_nor_runs_a_time_twice(db) {
        let store = &db.store;
        noop_plugin(store).await?;
        let t0 = store.now_ms().await? - 10_000;
        let s = store.create_schedule(&every("kept", 1000, Overlap::AllowAll, t0 - 1000)).await?;
        let first = store.backfill(&s, &[t0], Overlap::AllowAll).await?;
        ensure!(first.len() == 1 && first[0].run_id.is_some(), "{first:?}");
        // The record goes by age; its run (still queued) stays.
        sqlx::query("UPDATE schedule_ticks SET recorded_at = recorded_at - 3600000").execute(store.pool()).await?;
        ensure!(store.forget_old_ticks(60_000, 100).await? == 1);
        let again = store.backfill(&s, &[t0], Overlap::AllowAll).await?;
        ensure!(again.len() == 1 && again[0].run_id == first[0].run_id, "{again:?} after {first:?}");
        ensure!(runs_of(store, "kept").await?.len() == 1, "the time ran twice");
        // Through the API, a range past the retention period is refused.
        let config = leasehold::api::ApiConfig { retention: Duration::from_secs(3600), ..leasehold::api::ApiConfig::default() };
        let (base, http, stop) = api_with(db, config).await?;
        let now = store.now_ms().await?;
        let r = http.post(format!("{base}/v1/schedules/kept/backfill")).json(&json!({ "from": now - 7_200_000, "to": now - 1 })).send().await?;
        let status = r.status();
        let body: Value = r.json().await?;
        ensure!(status == 400 && body["error"]["message"].as_str().is_some_and(|m| m.contains("retention")), "{status} {body}");
        stop.stop().await;
        Ok(())
    }

    async fn the_service_refuses_a_schedule_past_its_cap(db) {
        noop_plugin(&db.store).await?;
        let config = leasehold::api::ApiConfig { max_schedules: 2, ..leasehold::api::ApiConfig::default() };
        let (base, http, stop) = api_with(db, config).await?;
        let mut got = Vec::new();
        for id in ["a", "b", "c"] {
            let r = http.post(format!("{base}/v1/schedules")).json(&json!({ "id": id, "plugin": "noop", "input": {}, "interval": "1h" })).send().await?;
            got.push(r.status().as_u16());
        }
        ensure!(got == [201, 201, 409], "{got:?}");
        stop.stop().await;
        Ok(())
    }
}
