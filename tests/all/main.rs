//! One integration-test binary (fewer links). Store tests run every body
//! against SQLite and PostgreSQL: see `harness::both!`.

mod harness;
mod plugins;
mod prefetch;

mod api;
mod bench_drain;
mod bench_e2e;
mod bench_fairness;
mod bench_submit;
mod chaos;
mod concurrency;
mod concurrency_keys;
mod crash;
mod dashboard;
mod edges;
mod fake_model;
mod hosts;
mod model;
mod netns;
mod partial;
mod priority;
mod rate_limits;
mod openapi;
mod orphans;
mod replay;
mod retention;
mod conformance;
mod interleaving;
mod kv_quota;
mod lease_cover;
mod layout;
mod lockwatch;
mod runtime;
mod sandbox;
mod search;
mod service;
mod submits;
mod slicing;
mod stream;
mod templates;
mod serve_proc;
mod sink;
mod upgrade;
mod vacuum;
mod wakeups;
