//! Devices: list, get, tag, revoke.

use std::collections::BTreeMap;

use axum::extract::State;
use serde::{Deserialize, Serialize};
use utoipa::ToSchema;

use crate::api::ErrorResponse;
use crate::api::error::{ApiError, ApiResult, Json, Path, Query};
use crate::api::pagination::{PageQuery, finish};
use crate::db::now_ms;
use crate::state::AppState;
use crate::store::devices::{self, DeviceRow};

#[derive(Debug, Serialize, ToSchema)]
pub struct DeviceView {
    pub id: i64,
    /// `end` or `edge`.
    pub tier: String,
    /// `device` (trains on its own data) or `aggregator` (an edge node),
    /// its enrollment token's role.
    pub role: String,
    pub backends: Vec<String>,
    /// The adapter behind the `gpu` backend, as the device reported it at
    /// enrollment; absent for devices without one, or that did not say.
    pub gpu: Option<GpuView>,
    pub memory_mb: i64,
    pub os: String,
    pub tags: BTreeMap<String, String>,
    /// Seen within the server's online window and not revoked.
    pub online: bool,
    pub last_seen_ms: i64,
    pub enrolled_ms: i64,
    pub revoked: bool,
    /// The device's Ed25519 public key, hex.
    pub public_key: String,
    /// The datasets the device reported it can train on.
    pub datasets: Vec<DatasetView>,
    /// The last error the device reported, if any.
    pub last_error: Option<String>,
    /// The device's state as its latest heartbeat that said reported it
    /// (mobile devices do); absent when it never did. Jobs with a
    /// `device_policy` pass over devices whose state violates it.
    pub conditions: Option<ConditionsView>,
}

/// A device's state, as it reported it.
#[derive(Debug, Serialize, ToSchema)]
pub struct ConditionsView {
    pub charging: bool,
    /// On a network the user does not pay for by the byte.
    pub unmetered_network: bool,
    pub idle: bool,
    #[schema(minimum = 0, maximum = 100)]
    pub battery_percent: u8,
}

/// A GPU adapter, as the device reported it.
#[derive(Debug, Serialize, ToSchema)]
pub struct GpuView {
    pub name: String,
    /// `vulkan`, `metal`, `dx12` or `gl`.
    pub api: String,
    /// `discrete`, `integrated`, `virtual`, `cpu` (a software
    /// implementation such as lavapipe) or `other`.
    pub device_type: String,
    pub driver: String,
}

/// A dataset a device holds, as it reported it; the data stays on the device.
#[derive(Debug, Serialize, ToSchema)]
pub struct DatasetView {
    pub name: String,
    pub samples: u64,
    /// The shape of one sample.
    pub sample_shape: Vec<u64>,
    pub classes: u64,
}

impl DeviceView {
    fn from_row(row: DeviceRow, online_since_ms: i64) -> ApiResult<DeviceView> {
        Ok(DeviceView {
            datasets: row
                .datasets()?
                .into_iter()
                .map(|d| DatasetView {
                    name: d.name,
                    samples: d.samples,
                    sample_shape: d.sample_shape,
                    classes: d.classes,
                })
                .collect(),
            last_error: row.last_error.clone(),
            conditions: row.conditions()?.map(|c| ConditionsView {
                charging: c.charging,
                unmetered_network: c.unmetered_network,
                idle: c.idle,
                battery_percent: c.battery_percent,
            }),
            gpu: row.gpu()?.map(|gpu| GpuView {
                name: gpu.name,
                api: gpu.api.to_string(),
                device_type: gpu.device_type.to_string(),
                driver: gpu.driver,
            }),
            backends: row.backends()?,
            tags: row.tags()?,
            online: row.revoked_ms.is_none() && row.last_seen_ms >= online_since_ms,
            id: row.id,
            role: row.role().map(|role| role.to_string())?,
            tier: row.tier,
            memory_mb: row.memory_mb,
            os: row.os,
            last_seen_ms: row.last_seen_ms,
            enrolled_ms: row.enrolled_ms,
            revoked: row.revoked_ms.is_some(),
            public_key: hex::encode(&row.public_key),
        })
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DeviceList {
    pub items: Vec<DeviceView>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Deserialize, ToSchema)]
#[serde(deny_unknown_fields)]
pub struct TagsUpdate {
    /// Replaces the device's tags.
    #[schema(schema_with = tags_schema)]
    pub tags: BTreeMap<String, String>,
}

/// The rules of [`check_tags`] (`Capabilities::validate`), as JSON Schema.
fn tags_schema() -> utoipa::openapi::schema::Object {
    use canopy_protocol::messages::{MAX_TAG_KEY_CHARS, MAX_TAG_VALUE_CHARS, MAX_TAGS};
    use utoipa::openapi::schema::{ObjectBuilder, Type};
    ObjectBuilder::new()
        .schema_type(Type::Object)
        .description(Some("Replaces the device's tags."))
        .max_properties(Some(MAX_TAGS))
        .property_names(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .pattern(Some(format!("^[A-Za-z0-9_.-]{{1,{MAX_TAG_KEY_CHARS}}}$"))),
        ))
        .additional_properties(Some(
            ObjectBuilder::new()
                .schema_type(Type::String)
                .max_length(Some(MAX_TAG_VALUE_CHARS))
                // No control characters (Unicode category Cc).
                .pattern(Some(r"^[^\u0000-\u001F\u007F-\u009F]*$")),
        ))
        .build()
}

fn online_since(state: &AppState) -> i64 {
    now_ms() - i64::try_from(state.settings.limits.online_window_ms).unwrap_or(i64::MAX)
}

/// List devices with their online state.
#[utoipa::path(
    get, path = "/api/v1/devices", tag = "devices", params(PageQuery),
    responses((status = 200, body = DeviceList), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list(
    State(state): State<AppState>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<DeviceList>> {
    let page = query.page(state.settings.limits.max_page_size)?;
    let rows = devices::list(&state.db, page).await?;
    let (rows, next_cursor) = finish(rows, page, |row| row.id.to_string());
    let since = online_since(&state);
    Ok(Json(DeviceList {
        items: rows
            .into_iter()
            .map(|row| DeviceView::from_row(row, since))
            .collect::<ApiResult<_>>()?,
        next_cursor,
    }))
}

async fn find(state: &AppState, id: i64) -> ApiResult<DeviceRow> {
    devices::get(&state.db, id)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("device {id} does not exist")))
}

/// Get one device.
#[utoipa::path(
    get, path = "/api/v1/devices/{id}", tag = "devices", params(("id" = i64, Path)),
    responses((status = 200, body = DeviceView), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> ApiResult<Json<DeviceView>> {
    let row = find(&state, id).await?;
    Ok(Json(DeviceView::from_row(row, online_since(&state))?))
}

/// Replace a device's tags.
#[utoipa::path(
    put, path = "/api/v1/devices/{id}/tags", tag = "devices", params(("id" = i64, Path)),
    request_body(content = TagsUpdate, example = json!({"tags": {"site": "lab-3", "rack": "b"}})),
    responses(
        (status = 200, body = DeviceView),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
        (status = 404, body = ErrorResponse), (status = 415, body = ErrorResponse), (status = 422, body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn set_tags(
    State(state): State<AppState>,
    Path(id): Path<i64>,
    Json(update): Json<TagsUpdate>,
) -> ApiResult<Json<DeviceView>> {
    check_tags(&update.tags).map_err(ApiError::unprocessable)?;
    if !devices::set_tags(&state.db, id, &update.tags).await? {
        return Err(ApiError::not_found(format!("device {id} does not exist")));
    }
    get(State(state), Path(id)).await
}

pub fn check_tags(tags: &BTreeMap<String, String>) -> Result<(), String> {
    let capabilities = canopy_protocol::messages::Capabilities {
        tier: canopy_protocol::messages::Tier::Edge,
        backends: Vec::new(),
        memory_mb: 0,
        os: String::new(),
        tags: tags.clone(),
        gpu: None,
    };
    capabilities.validate()
}

/// Revoke a device: it can no longer authenticate.
#[utoipa::path(
    post, path = "/api/v1/devices/{id}/revoke", tag = "devices", params(("id" = i64, Path)),
    responses((status = 200, body = DeviceView), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn revoke(
    State(state): State<AppState>,
    Path(id): Path<i64>,
) -> ApiResult<Json<DeviceView>> {
    let revoked = devices::revoke(&state.db, id).await?;
    state.device_keys.forget(id);
    if !revoked {
        return Err(ApiError::not_found(format!("device {id} does not exist")));
    }
    tracing::info!(device = id, "revoked device");
    get(State(state), Path(id)).await
}
