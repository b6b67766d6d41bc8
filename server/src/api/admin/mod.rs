//! The admin REST API, under `/api/v1`, and its access policy.

pub mod datasets;
pub mod devices;
pub mod jobs;
pub mod models;
pub mod tokens;

use axum::Router;
use axum::extract::DefaultBodyLimit;
use axum::extract::{Request, State};
use axum::http::{Method, header};
use axum::middleware::Next;
use axum::response::Response;
use axum::routing::{get, post, put};

use crate::api::error::ApiError;
use crate::state::AppState;
use crate::store::tokens::{Principal, Role, authenticate};

pub fn router() -> Router<AppState> {
    Router::new()
        .route("/api/v1/models", get(models::list_models))
        .route(
            "/api/v1/models/{name}/versions",
            post(models::upload_version).get(models::list_versions),
        )
        .route(
            "/api/v1/models/{name}/versions/{version}",
            get(models::get_version),
        )
        .route(
            "/api/v1/models/{name}/versions/{version}/download",
            get(models::download_version),
        )
        .route(
            "/api/v1/models/{name}/versions/{version}/lineage",
            get(models::lineage),
        )
        .route("/api/v1/jobs", post(jobs::create).get(jobs::list))
        .route("/api/v1/jobs/{id}", get(jobs::get))
        .route("/api/v1/jobs/{id}/start", post(jobs::start))
        .route("/api/v1/jobs/{id}/pause", post(jobs::pause))
        .route("/api/v1/jobs/{id}/resume", post(jobs::resume))
        .route("/api/v1/jobs/{id}/cancel", post(jobs::cancel))
        .route("/api/v1/jobs/{id}/rounds", get(jobs::list_rounds))
        .route("/api/v1/rounds/{id}", get(jobs::get_round))
        .route(
            "/api/v1/rounds/{id}/participants",
            get(jobs::list_participants),
        )
        .route("/api/v1/datasets", get(datasets::list))
        .route(
            "/api/v1/datasets/{name}",
            // The upload counts its bytes against `limits.max_dataset_bytes`.
            put(datasets::upload)
                .layer(DefaultBodyLimit::disable())
                .get(datasets::get)
                .delete(datasets::delete),
        )
        .route("/api/v1/devices", get(devices::list))
        .route("/api/v1/devices/{id}", get(devices::get))
        .route("/api/v1/devices/{id}/tags", put(devices::set_tags))
        .route("/api/v1/devices/{id}/revoke", post(devices::revoke))
        .route(
            "/api/v1/enrollment-tokens",
            post(tokens::create_enrollment_token).get(tokens::list_enrollment_tokens),
        )
        .route(
            "/api/v1/enrollment-tokens/{id}/revoke",
            post(tokens::revoke_enrollment_token),
        )
        .route(
            "/api/v1/tokens",
            post(tokens::create_api_token).get(tokens::list_api_tokens),
        )
        .route("/api/v1/tokens/{id}/revoke", post(tokens::revoke_api_token))
}

/// The role a request needs, from its method and path alone, so the whole
/// policy reads in one place: tokens are for admins, writes for operators,
/// reads for viewers.
pub fn required_role(method: &Method, path: &str) -> Role {
    if path == "/api/v1/tokens" || path.starts_with("/api/v1/tokens/") {
        Role::Admin
    } else if method == Method::GET || method == Method::HEAD {
        Role::Viewer
    } else {
        Role::Operator
    }
}

/// The token of an `Authorization: Bearer TOKEN` value. RFC 9110 §11.1:
/// the scheme is case-insensitive, and white space separates it from the
/// credentials (one space in the grammar; more, or a tab, is tolerated).
fn bearer_token(value: &str) -> Option<&str> {
    let (scheme, token) = value.split_once([' ', '\t'])?;
    let token = token.trim_matches([' ', '\t']);
    (scheme.eq_ignore_ascii_case("Bearer") && !token.is_empty()).then_some(token)
}

/// Authenticates the bearer token and applies [`required_role`]; runs
/// before any extractor, so an unauthenticated request learns nothing
/// (not even whether its path parameters parse).
pub async fn require_role(
    State(state): State<AppState>,
    mut request: Request,
    next: Next,
) -> Result<Response, ApiError> {
    let secret = request
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|value| value.to_str().ok())
        .and_then(bearer_token)
        .ok_or_else(|| {
            ApiError::unauthorized("missing `Authorization: Bearer TOKEN`; create a token with `canopy-server token create`")
        })?;
    let principal: Principal = authenticate(&state.db, secret)
        .await?
        .ok_or_else(|| ApiError::unauthorized("the bearer token is unknown, expired or revoked"))?;
    let needed = required_role(request.method(), request.uri().path());
    if principal.role < needed {
        return Err(ApiError::forbidden(format!(
            "this {} token cannot {} {}; it needs the {} role",
            principal.role.as_str(),
            request.method(),
            request.uri().path(),
            needed.as_str()
        )));
    }
    request.extensions_mut().insert(principal);
    Ok(next.run(request).await)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bearer_scheme_is_case_insensitive_and_spacing_tolerant() {
        for value in [
            "Bearer abc",
            "bearer abc",
            "BEARER abc",
            "Bearer   abc ",
            "bearer\tabc",
        ] {
            assert_eq!(bearer_token(value), Some("abc"), "{value:?}");
        }
        for value in [
            "Basic abc",
            "Bearerabc",
            "Bearers abc",
            "Bearer",
            "Bearer   ",
            "abc",
            "",
        ] {
            assert_eq!(bearer_token(value), None, "{value:?}");
        }
    }

    #[test]
    fn policy_reserves_tokens_for_admins_and_writes_for_operators() {
        assert_eq!(required_role(&Method::GET, "/api/v1/tokens"), Role::Admin);
        assert_eq!(
            required_role(&Method::POST, "/api/v1/tokens/3/revoke"),
            Role::Admin
        );
        assert_eq!(required_role(&Method::GET, "/api/v1/jobs"), Role::Viewer);
        assert_eq!(required_role(&Method::POST, "/api/v1/jobs"), Role::Operator);
        assert_eq!(
            required_role(&Method::PUT, "/api/v1/devices/1/tags"),
            Role::Operator
        );
        assert_eq!(
            required_role(&Method::POST, "/api/v1/enrollment-tokens"),
            Role::Operator
        );
        // A path that merely starts with the same letters is not a token route.
        assert_eq!(required_role(&Method::GET, "/api/v1/tokensx"), Role::Viewer);
    }
}
