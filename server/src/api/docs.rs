//! The OpenAPI 3.1 document, generated from the handlers' annotations; the
//! reference page that draws it (`web/api-docs.*`); and the dashboard.

use std::sync::OnceLock;

use axum::http::header;
use axum::response::{IntoResponse, Response};
use utoipa::openapi::security::{HttpAuthScheme, HttpBuilder, SecurityScheme};
use utoipa::{Modify, OpenApi};

use super::admin::{datasets, devices, jobs, models, tokens};

#[derive(OpenApi)]
#[openapi(
    info(
        title = "Canopy admin API",
        description = "Models, jobs, rounds, datasets, devices and tokens of a Canopy federated-learning server. \
                       Every route takes `Authorization: Bearer TOKEN`; errors are \
                       `{\"error\": {\"code\", \"message\"}}`; lists page with `limit` and `cursor`.",
    ),
    paths(
        models::list_models, models::upload_version, models::list_versions, models::get_version,
        models::download_version, models::lineage,
        jobs::create, jobs::list, jobs::get, jobs::start, jobs::pause, jobs::resume, jobs::cancel,
        jobs::list_rounds, jobs::get_round, jobs::list_participants,
        datasets::upload, datasets::list, datasets::get, datasets::delete,
        devices::list, devices::get, devices::set_tags, devices::revoke,
        tokens::create_enrollment_token, tokens::list_enrollment_tokens, tokens::revoke_enrollment_token,
        tokens::create_api_token, tokens::list_api_tokens, tokens::revoke_api_token,
    ),
    // Schemas that only parameters name: utoipa collects the schemas of
    // bodies, not of parameters, whose `$ref` would otherwise dangle.
    components(schemas(jobs::RoundOrder)),
    modifiers(&BearerAuth),
    tags(
        (name = "models", description = "Model files and their versions"),
        (name = "jobs", description = "Federated jobs and their rounds"),
        (name = "datasets", description = "Held-out datasets the server evaluates each version on"),
        (name = "devices", description = "Enrolled devices"),
        (name = "enrollment", description = "Tokens that let devices enroll"),
        (name = "tokens", description = "API tokens (admins only)"),
    )
)]
pub struct ApiDoc;

struct BearerAuth;

impl Modify for BearerAuth {
    fn modify(&self, openapi: &mut utoipa::openapi::OpenApi) {
        let components = openapi.components.get_or_insert_with(Default::default);
        components.add_security_scheme(
            "bearer",
            SecurityScheme::Http(HttpBuilder::new().scheme(HttpAuthScheme::Bearer).build()),
        );
    }
}

fn document() -> &'static str {
    static JSON: OnceLock<String> = OnceLock::new();
    JSON.get_or_init(|| {
        ApiDoc::openapi().to_pretty_json().unwrap_or_else(|error| {
            format!("{{\"error\": \"cannot render the OpenAPI document: {error}\"}}")
        })
    })
}

pub async fn openapi_json() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], document()).into_response()
}

/// The server's front page: links only, under the web pages' policy.
pub async fn index() -> Response {
    web_file(
        HTML,
        "<!doctype html><meta charset=utf-8><title>Canopy</title>\
         <h1>Canopy server</h1><ul>\
         <li><a href=\"/dashboard\">Dashboard</a></li>\
         <li><a href=\"/api/v1/docs\">API reference</a></li>\
         <li><a href=\"/api/v1/openapi.json\">OpenAPI document</a></li>\
         <li><a href=\"/metrics\">Metrics</a> (Prometheus text; send an admin API token)</li></ul>",
    )
}

/// The dashboard and the API reference page (`web/`), compiled in: static
/// files; the dashboard reads the admin API from the browser with the
/// user's token, the reference page draws `/api/v1/openapi.json` (so it can
/// never disagree with it). The content security policy allows only this
/// origin, so nothing else can run in the pages: no inline script or style,
/// no `eval`, no CDN (`server/tests/dashboard_browser.rs` checks the header
/// and that the pages raise no violation).
const DASHBOARD_HTML: &str = include_str!("../../../web/dashboard.html");
const DASHBOARD_JS: &str = include_str!("../../../web/dashboard.js");
const DASHBOARD_CHARTS_JS: &str = include_str!("../../../web/charts.js");
const DASHBOARD_CSS: &str = include_str!("../../../web/dashboard.css");
const DASHBOARD_ICON: &str = include_str!("../../../web/icon.svg");
const API_DOCS_HTML: &str = include_str!("../../../web/api-docs.html");
const API_DOCS_JS: &str = include_str!("../../../web/api-docs.js");
const API_DOCS_CSS: &str = include_str!("../../../web/api-docs.css");
const WEB_CSP: &str =
    "default-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'";

const HTML: &str = "text/html; charset=utf-8";
const JAVASCRIPT: &str = "text/javascript; charset=utf-8";
const CSS: &str = "text/css; charset=utf-8";

fn web_file(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CONTENT_SECURITY_POLICY, WEB_CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
            (header::REFERRER_POLICY, "no-referrer"),
        ],
        body,
    )
        .into_response()
}

pub async fn reference_page() -> Response {
    web_file(HTML, API_DOCS_HTML)
}

pub async fn reference_js() -> Response {
    web_file(JAVASCRIPT, API_DOCS_JS)
}

pub async fn reference_css() -> Response {
    web_file(CSS, API_DOCS_CSS)
}

pub async fn dashboard() -> Response {
    web_file(HTML, DASHBOARD_HTML)
}

pub async fn dashboard_js() -> Response {
    web_file(JAVASCRIPT, DASHBOARD_JS)
}

pub async fn dashboard_charts_js() -> Response {
    web_file(JAVASCRIPT, DASHBOARD_CHARTS_JS)
}

pub async fn dashboard_icon() -> Response {
    web_file("image/svg+xml", DASHBOARD_ICON)
}

pub async fn dashboard_css() -> Response {
    web_file(CSS, DASHBOARD_CSS)
}

#[cfg(test)]
mod tests {
    use canopy_protocol::bounds;
    use serde_json::Value;
    use utoipa::OpenApi;

    use crate::config::api_bounds::*;

    fn schema_property<'a>(document: &'a Value, schema: &str, name: &str) -> &'a Value {
        &document["components"]["schemas"][schema]["properties"][name]
    }

    /// Every parameter named `name` of every operation under `prefix`.
    fn parameters<'a>(document: &'a Value, prefix: &str, name: &str) -> Vec<&'a Value> {
        let operations = document["paths"].as_object().into_iter().flatten();
        operations
            .filter(|(path, _)| path.starts_with(prefix))
            .flat_map(|(_, path)| path.as_object().into_iter().flatten())
            .flat_map(|(_, operation)| operation["parameters"].as_array().into_iter().flatten())
            .filter(|parameter| parameter["name"] == name)
            .collect()
    }

    /// The document's bounds are literals (utoipa takes no constants), so
    /// this is what keeps them and the checks the server runs the same.
    #[test]
    fn the_document_states_the_bounds_the_server_checks() {
        let document: Value =
            serde_json::from_str(&super::ApiDoc::openapi().to_json().expect("renders"))
                .expect("JSON");
        let job = |name: &str| schema_property(&document, "JobSpec", name);
        assert_eq!(job("name")["maxLength"], MAX_JOB_NAME_CHARS);
        assert_eq!(job("rounds")["maximum"], MAX_ROUNDS);
        assert_eq!(job("min_devices")["maximum"], MAX_DEVICES_PER_ROUND);
        assert_eq!(job("target_devices")["maximum"], MAX_DEVICES_PER_ROUND);
        assert_eq!(job("over_selection")["maximum"], MAX_OVER_SELECTION);
        assert_eq!(job("round_deadline_ms")["minimum"], MIN_ROUND_DEADLINE_MS);
        assert_eq!(job("round_deadline_ms")["maximum"], MAX_ROUND_DEADLINE_MS);
        assert_eq!(job("max_round_retries")["maximum"], MAX_ROUND_RETRIES);
        let wait = job("max_wait_for_devices_ms");
        assert_eq!(wait["minimum"], MIN_WAIT_FOR_DEVICES_MS);
        assert_eq!(wait["maximum"], MAX_WAIT_FOR_DEVICES_MS);
        assert_eq!(job("local_epochs")["maximum"], bounds::MAX_EPOCHS);
        assert_eq!(job("batch_size")["maximum"], bounds::MAX_BATCH_SIZE);
        assert_eq!(job("learning_rate")["maximum"], bounds::MAX_LEARNING_RATE);
        let buffers = |name: &str| schema_property(&document, "Asynchronous", name);
        assert_eq!(buffers("concurrency")["maximum"], MAX_DEVICES_PER_ROUND);
        assert_eq!(buffers("max_staleness")["maximum"], bounds::MAX_STALENESS);
        assert_eq!(
            buffers("staleness_exponent")["maximum"],
            bounds::MAX_STALENESS_EXPONENT
        );
        let edges = |name: &str| schema_property(&document, "EdgeTier", name);
        assert_eq!(edges("rounds")["maximum"], bounds::MAX_SUB_ROUND_VERSIONS);
        assert_eq!(edges("target_devices")["maximum"], MAX_DEVICES_PER_ROUND);
        let backends = schema_property(&document, "DeviceFilter", "backends");
        assert_eq!(backends["maxItems"], MAX_FILTER_BACKENDS);
        let gpu_types = schema_property(&document, "DeviceFilter", "gpu_types");
        let names: Vec<&str> = canopy_protocol::messages::GpuDeviceType::ALL
            .iter()
            .map(|kind| kind.as_str())
            .collect();
        assert_eq!(gpu_types["items"]["enum"], serde_json::json!(names));
        assert_eq!(gpu_types["uniqueItems"], true);
        let battery = schema_property(&document, "DevicePolicySchema", "min_battery_percent");
        assert_eq!(
            battery["maximum"],
            canopy_protocol::messages::MAX_BATTERY_PERCENT
        );
        let policy = &document["components"]["schemas"]["DevicePolicySchema"];
        let fields: Vec<&str> = policy["properties"]
            .as_object()
            .expect("the policy's properties")
            .keys()
            .map(String::as_str)
            .collect();
        let mut expected = canopy_protocol::messages::DevicePolicy::FIELDS.to_vec();
        expected.sort_unstable();
        assert_eq!(fields, expected);
        assert_eq!(policy["additionalProperties"], false);
        for schema in ["CreateApiToken", "CreateEnrollmentToken"] {
            let label = schema_property(&document, schema, "label");
            assert_eq!(label["maxLength"], MAX_LABEL_CHARS, "{schema}");
        }
        let uses = schema_property(&document, "CreateEnrollmentToken", "max_uses");
        assert_eq!(uses["maximum"], MAX_ENROLLMENT_USES);
        let rounds_page = &document["paths"]["/api/v1/jobs/{id}/rounds"]["get"]["parameters"];
        let limit = rounds_page
            .as_array()
            .and_then(|all| all.iter().find(|p| p["name"] == "limit"))
            .expect("the rounds list takes `limit`");
        assert_eq!(limit["schema"]["maximum"], MAX_ROUNDS_PAGE);
        let model_name = format!(
            "^[A-Za-z0-9_-][A-Za-z0-9._-]{{0,{}}}$",
            MAX_MODEL_NAME_BYTES - 1
        );
        let names = parameters(&document, "/api/v1/models/", "name");
        assert!(!names.is_empty(), "model routes take `name`");
        for name in names {
            assert_eq!(name["schema"]["pattern"], model_name.as_str(), "{name}");
        }
        let names = parameters(&document, "/api/v1/datasets/", "name");
        assert_eq!(names.len(), 3, "dataset routes take `name`");
        for name in names {
            let pattern = crate::api::admin::datasets::NAME_PATTERN;
            assert_eq!(name["schema"]["pattern"], pattern, "{name}");
        }
    }
}
