//! API tokens (admins only) and device enrollment tokens (operators).

use std::time::Duration;

use axum::Extension;
use axum::extract::State;
use axum::http::StatusCode;
use canopy_protocol::messages::DeviceRole;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::ErrorResponse;
use crate::api::error::{ApiError, ApiResult, Json, Path, Query};
use crate::api::pagination::{PageQuery, finish};
use crate::config::api_bounds::{MAX_ENROLLMENT_USES, MAX_LABEL_CHARS, MAX_TOKEN_LIFETIME};
use crate::db::now_ms;
use crate::state::AppState;
use crate::store::tokens::{self, ApiTokenRow, EnrollmentTokenRow, Principal, Role, TokenState};

/// The OpenAPI shape of `expires_in`: a string of at least two characters
/// that matches [`LIFETIME_PATTERN`].
pub struct Lifetime;

/// humantime's grammar, which [`parse_lifetime`] uses: one or more numbers
/// (white space may fall inside; a fraction is allowed), each followed by
/// one of its unit names. Every lifetime the server accepts matches, so no
/// valid request breaks the document; the bounds (above zero, at most 10
/// years), which no pattern can state, are in the description.
pub const LIFETIME_PATTERN: &str = r"^[\s\u0085]*(?:[0-9][0-9\s\u0085]*(?:\.[0-9\s\u0085]*)?(?:nanos|nsec|ns|usec|us|\u00B5s|millis|msec|ms|seconds|second|secs|sec|s|minutes|minute|mins|min|m|hours|hour|hrs|hr|h|days|day|d|weeks|week|wks|wk|w|months|month|M|years|year|yrs|yr|y)[\s\u0085]*)+$";

impl utoipa::PartialSchema for Lifetime {
    fn schema() -> utoipa::openapi::RefOr<utoipa::openapi::schema::Schema> {
        utoipa::openapi::schema::ObjectBuilder::new()
            .schema_type(utoipa::openapi::schema::Type::String)
            .min_length(Some(2))
            .pattern(Some(LIFETIME_PATTERN))
            .description(Some(
                "A lifetime such as `30d`, `12h` or `1h 30m`: above zero and at most 10 years.",
            ))
            .examples(["30d"])
            .into()
    }
}

impl ToSchema for Lifetime {}

/// Parses lifetimes such as `30d`, `12h` or `90m`.
pub fn parse_lifetime(text: &str) -> Result<Duration, String> {
    let lifetime = humantime::parse_duration(text)
        .map_err(|error| format!("lifetime `{text}` is not a duration like 30d or 12h: {error}"))?;
    if lifetime.is_zero() || lifetime > MAX_TOKEN_LIFETIME {
        return Err(format!(
            "lifetime `{text}` must be above zero and at most 10 years"
        ));
    }
    Ok(lifetime)
}

fn expiry_ms(lifetime: Duration) -> i64 {
    now_ms().saturating_add(i64::try_from(lifetime.as_millis()).unwrap_or(i64::MAX))
}

fn check_label(label: &str) -> ApiResult<()> {
    // Characters, not bytes: the limit the OpenAPI document states as
    // `maxLength`, which JSON Schema counts in characters.
    let chars = label.chars().count();
    if chars > MAX_LABEL_CHARS {
        return Err(ApiError::unprocessable(format!(
            "`label` is {chars} characters, over the {MAX_LABEL_CHARS}-character limit"
        )));
    }
    // They would let a label forge lines in logs, and PostgreSQL refuses NUL.
    if label.chars().any(char::is_control) {
        return Err(ApiError::unprocessable(
            "`label` contains control characters",
        ));
    }
    Ok(())
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateApiToken {
    pub role: Role,
    /// Up to 128 characters, no control characters.
    #[serde(default)]
    #[schema(max_length = 128, pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub label: String,
    /// Lifetime such as `30d` or `12h`, above zero and at most 10 years;
    /// no expiry when absent or null.
    #[serde(default)]
    #[schema(value_type = Option<Lifetime>)]
    pub expires_in: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ApiTokenView {
    pub id: i64,
    pub role: String,
    pub label: String,
    pub created_ms: i64,
    pub expires_ms: Option<i64>,
    /// Whether it authenticates now: `active`, `expired` or `revoked`.
    pub state: TokenState,
}

impl ApiTokenView {
    /// The token as it stands at `now_ms`.
    pub fn at(row: ApiTokenRow, now_ms: i64) -> ApiTokenView {
        ApiTokenView {
            id: row.id,
            state: row.state(now_ms),
            role: row.role,
            label: row.label,
            created_ms: row.created_ms,
            expires_ms: row.expires_ms,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedApiToken {
    #[serde(flatten)]
    pub token: ApiTokenView,
    /// The bearer secret. Shown once; the server keeps only its hash.
    pub secret: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ApiTokenList {
    pub items: Vec<ApiTokenView>,
    pub next_cursor: Option<String>,
}

/// Create an API token (admins only).
#[utoipa::path(
    post, path = "/api/v1/tokens", tag = "tokens",
    request_body(content = CreateApiToken, example = json!({"role": "viewer", "label": "dashboard", "expires_in": "30d"})),
    responses(
        (status = 201, body = CreatedApiToken),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
        (status = 415, body = ErrorResponse), (status = 422, body = ErrorResponse), (status = 429, body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn create_api_token(
    State(state): State<AppState>,
    Json(request): Json<CreateApiToken>,
) -> ApiResult<(StatusCode, Json<CreatedApiToken>)> {
    check_label(&request.label)?;
    let expires = match &request.expires_in {
        Some(text) => Some(expiry_ms(
            parse_lifetime(text).map_err(ApiError::unprocessable)?,
        )),
        None => None,
    };
    let (row, secret) =
        tokens::create_api_token(&state.db, request.role, &request.label, expires).await?;
    tracing::info!(token = row.id, role = %row.role, "created API token");
    Ok((
        StatusCode::CREATED,
        Json(CreatedApiToken {
            token: ApiTokenView::at(row, now_ms()),
            secret,
        }),
    ))
}

/// List API tokens (admins only).
#[utoipa::path(
    get, path = "/api/v1/tokens", tag = "tokens", params(PageQuery),
    responses((status = 200, body = ApiTokenList), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list_api_tokens(
    State(state): State<AppState>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<ApiTokenList>> {
    let page = query.page(state.settings.limits.max_page_size)?;
    let rows = tokens::list_api_tokens(&state.db, page).await?;
    let (rows, next_cursor) = finish(rows, page, |row| row.id.to_string());
    let now_ms = now_ms();
    Ok(Json(ApiTokenList {
        items: rows
            .into_iter()
            .map(|row| ApiTokenView::at(row, now_ms))
            .collect(),
        next_cursor,
    }))
}

/// Revoke an API token (admins only). A token cannot revoke itself, so an
/// admin cannot lock themselves out by mistake.
#[utoipa::path(
    post, path = "/api/v1/tokens/{id}/revoke", tag = "tokens", params(("id" = i64, Path)),
    responses(
        (status = 204, description = "Revoked"), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse),
        (status = 403, body = ErrorResponse), (status = 404, body = ErrorResponse),
        (status = 409, description = "The token making the request", body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn revoke_api_token(
    State(state): State<AppState>,
    Extension(principal): Extension<Principal>,
    Path(id): Path<i64>,
) -> ApiResult<StatusCode> {
    if id == principal.token_id {
        return Err(ApiError::conflict(format!(
            "API token {id} is the one making this request and cannot revoke itself; \
             revoke it with another admin token or `canopy-server token revoke {id}`"
        )));
    }
    if !tokens::revoke_api_token(&state.db, id).await? {
        return Err(ApiError::not_found(format!(
            "API token {id} does not exist"
        )));
    }
    tracing::info!(token = id, "revoked API token");
    Ok(StatusCode::NO_CONTENT)
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct CreateEnrollmentToken {
    /// Up to 128 characters, no control characters.
    #[serde(default)]
    #[schema(max_length = 128, pattern = "^[^\\u0000-\\u001F\\u007F-\\u009F]*$")]
    pub label: String,
    /// Lifetime such as `7d` or `12h`, above zero and at most 10 years.
    #[schema(value_type = Lifetime)]
    pub expires_in: String,
    /// Devices that may enroll with it.
    #[schema(minimum = 1, maximum = 1_000_000)]
    pub max_uses: u32,
    /// The role of the devices it enrolls: `device` (the default) trains
    /// on its own data, `aggregator` is an edge node.
    #[serde(default)]
    #[schema(schema_with = device_role_schema)]
    pub role: DeviceRole,
}

/// `DeviceRole`'s names, from the enum.
fn device_role_schema() -> utoipa::openapi::schema::Object {
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    let names = DeviceRole::ALL.iter().map(|role| role.as_str());
    ObjectBuilder::new()
        .schema_type(Type::String)
        .enum_values(Some(names))
        .default(Some(serde_json::json!(DeviceRole::default().as_str())))
        .build()
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EnrollmentTokenView {
    pub id: i64,
    pub label: String,
    pub created_ms: i64,
    pub expires_ms: i64,
    pub max_uses: i64,
    pub uses: i64,
    pub revoked: bool,
    /// The role of the devices it enrolls.
    pub role: String,
}

impl From<EnrollmentTokenRow> for EnrollmentTokenView {
    fn from(row: EnrollmentTokenRow) -> EnrollmentTokenView {
        EnrollmentTokenView {
            role: row.device_role,
            id: row.id,
            label: row.label,
            created_ms: row.created_ms,
            expires_ms: row.expires_ms,
            max_uses: row.max_uses,
            uses: row.uses,
            revoked: row.revoked_ms.is_some(),
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct CreatedEnrollmentToken {
    #[serde(flatten)]
    pub token: EnrollmentTokenView,
    /// Give this to `canopy-agent enroll --token`. Shown once.
    pub secret: String,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct EnrollmentTokenList {
    pub items: Vec<EnrollmentTokenView>,
    pub next_cursor: Option<String>,
}

/// Create an enrollment token for devices.
#[utoipa::path(
    post, path = "/api/v1/enrollment-tokens", tag = "enrollment",
    request_body(content = CreateEnrollmentToken, example = json!({"label": "lab fleet", "expires_in": "7d", "max_uses": 50})),
    responses(
        (status = 201, body = CreatedEnrollmentToken),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
        (status = 415, body = ErrorResponse), (status = 422, body = ErrorResponse), (status = 429, body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn create_enrollment_token(
    State(state): State<AppState>,
    Json(request): Json<CreateEnrollmentToken>,
) -> ApiResult<(StatusCode, Json<CreatedEnrollmentToken>)> {
    check_label(&request.label)?;
    if request.max_uses == 0 || request.max_uses > MAX_ENROLLMENT_USES {
        return Err(ApiError::unprocessable(format!(
            "`max_uses` must be between 1 and {MAX_ENROLLMENT_USES}, got {}",
            request.max_uses
        )));
    }
    let lifetime = parse_lifetime(&request.expires_in).map_err(ApiError::unprocessable)?;
    let new = tokens::NewEnrollmentToken {
        label: &request.label,
        expires_ms: expiry_ms(lifetime),
        max_uses: i64::from(request.max_uses),
        device_role: request.role,
    };
    let (row, secret) = tokens::create_enrollment_token(&state.db, &new).await?;
    tracing::info!(
        token = row.id,
        max_uses = row.max_uses,
        role = %request.role,
        "created enrollment token"
    );
    Ok((
        StatusCode::CREATED,
        Json(CreatedEnrollmentToken {
            token: row.into(),
            secret,
        }),
    ))
}

/// List enrollment tokens.
#[utoipa::path(
    get, path = "/api/v1/enrollment-tokens", tag = "enrollment", params(PageQuery),
    responses((status = 200, body = EnrollmentTokenList), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list_enrollment_tokens(
    State(state): State<AppState>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<EnrollmentTokenList>> {
    let page = query.page(state.settings.limits.max_page_size)?;
    let rows = tokens::list_enrollment_tokens(&state.db, page).await?;
    let (rows, next_cursor) = finish(rows, page, |row| row.id.to_string());
    Ok(Json(EnrollmentTokenList {
        items: rows.into_iter().map(Into::into).collect(),
        next_cursor,
    }))
}

/// Revoke an enrollment token; devices already enrolled stay enrolled.
#[utoipa::path(
    post, path = "/api/v1/enrollment-tokens/{id}/revoke", tag = "enrollment", params(("id" = i64, Path)),
    responses((status = 204, description = "Revoked"), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn revoke_enrollment_token(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> ApiResult<StatusCode> {
    if !tokens::revoke_enrollment_token(&state.db, id).await? {
        return Err(ApiError::not_found(format!(
            "enrollment token {id} does not exist"
        )));
    }
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_are_counted_in_characters_and_refuse_control_characters() {
        assert!(check_label(&"é".repeat(MAX_LABEL_CHARS)).is_ok());
        assert!(check_label(&"e".repeat(MAX_LABEL_CHARS + 1)).is_err());
        for label in ["a\0b", "line\nforged", "\u{85}"] {
            assert!(check_label(label).is_err(), "{label:?}");
        }
    }
}
