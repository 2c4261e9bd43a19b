//! `GET /v1/openapi.json`: the API's OpenAPI 3.1 description, derived from
//! the handlers' own types and annotations, so it cannot drift from them.
//! The errors every endpoint can give (bad input, auth, the front door, a
//! busy or unreachable database) are added to each operation here, once.

use axum::Json;
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::openapi::{Content, HttpMethod, OpenApi as Doc, Ref, RefOr, Response, ResponseBuilder};
use utoipa::{Modify, OpenApi};

use super::error::{ErrorBody, ErrorDetail};
use super::{events, limits, overview, plugins, runs};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "leasehold",
        description = "Runs of WebAssembly turns under fenced leases, with an effect ledger. \
            Every error is `{\"error\": {\"code\", \"message\"}}`. Times are epoch milliseconds \
            from the database's clock.",
        license(name = "see the project's repository"),
    ),
    paths(
        runs::submit, runs::submit_batch, runs::list, runs::show, runs::input, runs::cancel, runs::effects,
        super::children::children, super::segments::segments, super::answers::answer, super::answers::page, super::budget::show, super::budget::set,
        super::resolve::resolve, super::pause::pause, super::pause::resume, super::rerun::rerun,
        plugins::list, plugins::show, plugins::put,
        limits::list, limits::show, limits::put, limits::remove,
        super::schedules::create, super::schedules::list, super::schedules::show, super::schedules::change,
        super::schedules::remove, super::schedules::backfill, super::schedules::ticks,
        events::events,
        overview::stats, overview::leases, super::history::history,
        super::metrics::metrics, super::healthz, openapi,
    ),
    components(schemas(ErrorBody, ErrorDetail)),
    modifiers(&Common),
    tags(
        (name = "runs", description = "Submit, list, show, deliver input, cancel; a run's ledger."),
        (name = "plugins", description = "Register components and list their versions."),
        (name = "limits", description = "Concurrency keys: their limits, pauses and runs."),
        (name = "schedules", description = "Runs started by cron expressions or intervals, with their ticks and backfills."),
        (name = "events", description = "A thread's durable event log, as JSON or a live stream."),
        (name = "hosts", description = "Counts, leases and takeovers."),
        (name = "service", description = "Health and this description."),
    ),
)]
pub struct ApiDoc;

/// `GET /v1/openapi.json`. Needs no token: it describes, it holds no data.
#[utoipa::path(get, path = "/v1/openapi.json", tag = "service", security(()),
    responses((status = 200, description = "This description.", body = Object)))]
pub async fn openapi() -> Json<Doc> {
    Json(ApiDoc::openapi())
}

/// The bearer scheme, and the errors any operation can give.
struct Common;

impl Modify for Common {
    fn modify(&self, doc: &mut Doc) {
        let components = doc.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).description(Some(
                "The token `leasehold serve` writes to its token file.",
            )).build()),
        );
        doc.security = Some(vec![utoipa::openapi::security::SecurityRequirement::new("bearer", Vec::<String>::new())]);
        for (path, item) in doc.paths.paths.iter_mut() {
            let public = path == "/healthz" || path == "/v1/openapi.json";
            for (method, op) in [
                (HttpMethod::Get, &mut item.get),
                (HttpMethod::Post, &mut item.post),
                (HttpMethod::Put, &mut item.put),
                (HttpMethod::Patch, &mut item.patch),
                (HttpMethod::Delete, &mut item.delete),
            ] {
                let Some(op) = op.as_mut() else { continue };
                let mut add = |status: &str, why: &str| {
                    op.responses.responses.entry(status.to_string()).or_insert_with(|| error(why));
                };
                add("400", "Malformed input: a path, query or body that is not what this operation takes.");
                if !public {
                    add("401", "No bearer token, or a wrong one.");
                }
                add("405", "The path takes other methods.");
                if [HttpMethod::Post, HttpMethod::Put, HttpMethod::Patch].contains(&method) {
                    add("413", "The body is over its cap (JSON: 1 MiB by default).");
                }
                if method == HttpMethod::Post || method == HttpMethod::Patch {
                    add("415", "A POST or PATCH must say Content-Type: application/json.");
                }
                add("421", "The Host header names neither an IP address, localhost nor a configured name.");
                add("503", "The host is at a cap (with Retry-After), timed out, or cannot reach its database.");
            }
        }
    }
}

fn error(description: &str) -> RefOr<Response> {
    RefOr::T(
        ResponseBuilder::new()
            .description(description)
            .content("application/json", Content::new(Some(Ref::from_schema_name("ErrorBody"))))
            .build(),
    )
}
