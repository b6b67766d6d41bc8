//! Models and versions: upload, list, get, download, lineage.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use bytes::Bytes;
use canopy_protocol::update::UpdateLayout;
use serde::Serialize;
use utoipa::ToSchema;

use crate::api::error::{ApiError, ApiResult, Json, Path, Query};
use crate::api::pagination::{PageQuery, finish};
use crate::api::upload_slot;
use crate::config::api_bounds::{MAX_LINEAGE, MAX_MODEL_NAME_BYTES};
use crate::fedavg;
use crate::state::AppState;
use crate::store::models::{self, NewVersion, VersionRow};
use canopy_term::error_chain as chain;

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelVersionView {
    /// Server-wide id of this version (jobs refer to it).
    pub id: i64,
    pub model: String,
    /// 1 for the first upload, then one more for each upload or round.
    pub version: i64,
    /// The model file's content digest (SHA-256, hex).
    pub digest: String,
    pub size_bytes: i64,
    pub trainable_elements: i64,
    /// Whether devices can train it: a `train_step` and f32 trainable parameters.
    pub trainable: bool,
    /// Why devices cannot train it; `null` when they can (or, for versions
    /// stored by older servers, when the reason was not kept).
    pub untrainable_reason: Option<String>,
    /// The id of the version it was made from.
    pub parent_version_id: Option<i64>,
    /// That parent's `version` number (both are versions of this model).
    pub parent_version: Option<i64>,
    /// The job that produced it, for versions made by a job (a round's
    /// result, or the FedProx step a job derived before its first round).
    pub produced_by_job: Option<i64>,
    /// The id of the round that produced it.
    pub produced_by_round: Option<i64>,
    /// That round's `number` in its job: 1 for the first training round,
    /// 0 for the statistics round that fits a model's input statistics.
    pub produced_by_round_number: Option<i64>,
    pub created_ms: i64,
}

impl From<VersionRow> for ModelVersionView {
    fn from(row: VersionRow) -> ModelVersionView {
        ModelVersionView {
            id: row.id,
            model: row.model_name,
            version: row.version,
            digest: row.digest,
            size_bytes: row.size_bytes,
            trainable_elements: row.trainable_elements,
            trainable: row.has_train_step != 0,
            untrainable_reason: row.untrainable_reason,
            parent_version_id: row.parent_version_id,
            parent_version: row.parent_version,
            produced_by_job: row.job_id,
            produced_by_round: row.round_id,
            produced_by_round_number: row.round_number,
            created_ms: row.created_ms,
        }
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelVersionList {
    pub items: Vec<ModelVersionView>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelView {
    pub name: String,
    pub versions: i64,
    pub created_ms: i64,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct ModelList {
    pub items: Vec<ModelView>,
    pub next_cursor: Option<String>,
}

#[derive(Debug, Serialize, ToSchema)]
pub struct Lineage {
    /// The version asked for, then its parent, grandparent, …
    pub chain: Vec<ModelVersionView>,
    /// True when the chain was cut at the server's limit.
    pub truncated: bool,
}

/// The OpenAPI document states this rule as the `name` parameter's pattern,
/// `^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$`; keep the two in step.
pub fn check_model_name(name: &str) -> ApiResult<()> {
    let valid = !name.is_empty()
        && name.len() <= MAX_MODEL_NAME_BYTES
        && name
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
        && !name.starts_with('.');
    if !valid {
        return Err(ApiError::bad_request(format!(
            "model name `{}` is invalid: use 1 to {MAX_MODEL_NAME_BYTES} letters, digits, `-`, `_` or `.`, not starting with `.`",
            name.chars().take(80).collect::<String>()
        )));
    }
    Ok(())
}

/// Upload a new version of a model (a Canopy IR file as the raw body).
#[utoipa::path(
    post, path = "/api/v1/models/{name}/versions", tag = "models",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$", description = "Model name: letters, digits, `-`, `_`, `.`; not starting with `.`")),
    request_body(content = Vec<u8>, content_type = "application/octet-stream", description = "A Canopy IR file"),
    responses(
        (status = 201, description = "Stored", body = ModelVersionView),
        (status = 400, description = "Bad model name", body = crate::api::ErrorResponse),
        (status = 401, body = crate::api::ErrorResponse), (status = 403, body = crate::api::ErrorResponse),
        (status = 413, description = "Over the model size limit", body = crate::api::ErrorResponse),
        (status = 422, description = "Not a valid Canopy IR file", body = crate::api::ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn upload_version(
    State(state): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<(StatusCode, Json<ModelVersionView>)> {
    check_model_name(&name)?;
    let limit = state.settings.limits.max_model_bytes;
    refuse_declared_over(&headers, limit, "model file")?;
    let _slot = upload_slot(&state, &state.model_upload_slots, None).await?;
    let staged = stage_body(&state, body, limit).await?;
    // Verifying needs the file and its parsed model in memory at once, so
    // uploads are verified one at a time: about twice the largest model,
    // however many operators upload together.
    let _verifying = state
        .model_verification
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let bytes = tokio::fs::read(staged.path()).await.map_err(|error| {
        ApiError::internal(format!("cannot read the staged model file: {error}"))
    })?;
    drop(staged);
    let row = store_version(&state, &name, bytes.into(), None, None, None).await?;
    Ok((StatusCode::CREATED, Json(row.into())))
}

/// Where model uploads are written while they arrive.
pub fn staging_dir(state: &AppState) -> std::path::PathBuf {
    state.settings.data_dir.join("staging")
}

/// Streams a body to a temporary file in [`staging_dir`], stopping at
/// `limit`, so that a slow upload holds disk, not memory. The file is
/// removed when the returned handle is dropped.
async fn stage_body(
    state: &AppState,
    body: Body,
    limit: u64,
) -> ApiResult<tempfile::NamedTempFile> {
    use futures_util::StreamExt;
    use tokio::io::AsyncWriteExt;
    let dir = staging_dir(state);
    let io_error = |error: std::io::Error| {
        ApiError::internal(format!(
            "cannot stage the model upload in {}: {error}",
            dir.display()
        ))
    };
    tokio::fs::create_dir_all(&dir).await.map_err(io_error)?;
    let staged = tempfile::NamedTempFile::new_in(&dir).map_err(io_error)?;
    let mut file = tokio::fs::File::from_std(staged.reopen().map_err(io_error)?);
    let mut stream = body.into_data_stream();
    let mut written = 0u64;
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|error| {
            ApiError::bad_request(format!("cannot read the model file: {}", chain(&error)))
        })?;
        written += chunk.len() as u64;
        if written > limit {
            return Err(ApiError::too_large(format!(
                "model file is over the {limit}-byte limit"
            )));
        }
        file.write_all(&chunk).await.map_err(io_error)?;
    }
    file.flush().await.map_err(io_error)?;
    Ok(staged)
}

/// 413 from the headers alone when the declared length is over `limit`.
pub fn refuse_declared_over(headers: &HeaderMap, limit: u64, what: &str) -> ApiResult<()> {
    match content_length(headers) {
        Some(length) if length > limit => Err(ApiError::too_large(format!(
            "{what} is {length} bytes, over the {limit}-byte limit"
        ))),
        _ => Ok(()),
    }
}

pub fn content_length(headers: &HeaderMap) -> Option<u64> {
    headers
        .get(header::CONTENT_LENGTH)?
        .to_str()
        .ok()?
        .parse()
        .ok()
}

/// Verifies, stores and records a model file as the next version.
pub async fn store_version(
    state: &AppState,
    name: &str,
    bytes: Bytes,
    parent_version_id: Option<i64>,
    job_id: Option<i64>,
    round_id: Option<i64>,
) -> ApiResult<VersionRow> {
    let limits = canopy_ir::format::ReadLimits {
        max_file_bytes: state.settings.limits.max_model_bytes,
        ..canopy_ir::format::ReadLimits::default()
    };
    let parsed = {
        let bytes = bytes.clone();
        tokio::task::spawn_blocking(move || {
            canopy_ir::format::read_model_with_limits(&bytes, &limits)
                .map(|model| fedavg::check_trainable(&model))
        })
        .await
        .map_err(|error| ApiError::internal(format!("model verification task failed: {error}")))?
    };
    let trainable = parsed.map_err(|error| {
        ApiError::unprocessable(format!("the model file is invalid: {}", chain(&error)))
    })?;
    // An untrainable model is still stored (it can be downloaded and
    // evaluated); the reason is kept for the job that would train it.
    let (layout, untrainable_reason) = match trainable {
        Ok(layout) => (layout, None),
        Err(error) => (
            UpdateLayout {
                tensors: Vec::new(),
            },
            Some(chain(&error)),
        ),
    };
    let digest = canopy_ir::format::digest(&bytes)
        .map(|d| canopy_ir::format::digest_hex(&d))
        .map_err(|error| ApiError::unprocessable(chain(&error)))?;
    state.blobs.put(&digest, bytes.clone()).await?;
    let new = NewVersion {
        model_name: name,
        digest: &digest,
        size_bytes: bytes.len() as u64,
        layout: &layout,
        untrainable_reason: untrainable_reason.as_deref(),
        parent_version_id,
        job_id,
        round_id,
    };
    let _writer = state.db.write_lock().await;
    let mut tx = state.db.pool.begin().await?;
    let row = models::insert_version(&mut tx, &new).await?;
    tx.commit().await?;
    tracing::info!(model = name, version = row.version, digest = %row.digest, "stored model version");
    Ok(row)
}

/// List models.
#[utoipa::path(
    get, path = "/api/v1/models", tag = "models",
    params(
        ("limit" = Option<u32>, Query, minimum = 1, maximum = 500, description = "Items per page"),
        ("cursor" = Option<String>, Query, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$", description = "`next_cursor` of the previous page (a model name)"),
    ),
    responses((status = 200, body = ModelList), (status = 400, body = crate::api::ErrorResponse), (status = 401, body = crate::api::ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list_models(
    State(state): State<AppState>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<ModelList>> {
    let limit = query.limit(state.settings.limits.max_page_size)?;
    // The cursor is the last model name of the previous page.
    if let Some(cursor) = &query.cursor
        && check_model_name(cursor).is_err()
    {
        return Err(ApiError::bad_request(format!(
            "cursor `{}` is not one this server issued: it is not a model name",
            cursor.chars().take(64).collect::<String>()
        )));
    }
    let after = query.cursor.clone().unwrap_or_default();
    let rows = models::list_models(&state.db, &after, i64::from(limit) + 1).await?;
    let page = crate::store::Page {
        after: 0,
        limit: i64::from(limit) + 1,
    };
    let (rows, next_cursor) = finish(rows, page, |row| row.name.clone());
    Ok(Json(ModelList {
        items: rows
            .into_iter()
            .map(|row| ModelView {
                name: row.name,
                versions: row.versions,
                created_ms: row.created_ms,
            })
            .collect(),
        next_cursor,
    }))
}

/// List a model's versions, oldest first.
#[utoipa::path(
    get, path = "/api/v1/models/{name}/versions", tag = "models",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"), PageQuery),
    responses(
        (status = 200, body = ModelVersionList), (status = 400, body = crate::api::ErrorResponse),
        (status = 401, body = crate::api::ErrorResponse),
        (status = 404, description = "No model of this name", body = crate::api::ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn list_versions(
    State(state): State<AppState>,
    Path(name): Path<String>,
    Query(query): Query<PageQuery>,
) -> ApiResult<Json<ModelVersionList>> {
    check_model_name(&name)?;
    let page = query.page(state.settings.limits.max_page_size)?;
    let rows = models::list_versions(&state.db, &name, page).await?;
    // An empty page is the end of a model's list, or no model at all.
    if rows.is_empty() && !models::exists(&state.db, &name).await? {
        return Err(ApiError::not_found(format!(
            "model `{name}` does not exist"
        )));
    }
    let (rows, next_cursor) = finish(rows, page, |row| row.version.to_string());
    Ok(Json(ModelVersionList {
        items: rows.into_iter().map(Into::into).collect(),
        next_cursor,
    }))
}

pub async fn find(state: &AppState, name: &str, version: i64) -> ApiResult<VersionRow> {
    check_model_name(name)?;
    models::find_version(&state.db, name, version)
        .await?
        .ok_or_else(|| ApiError::not_found(format!("model `{name}` has no version {version}")))
}

/// Get one version.
#[utoipa::path(
    get, path = "/api/v1/models/{name}/versions/{version}", tag = "models",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"), ("version" = i64, Path)),
    responses((status = 200, body = ModelVersionView), (status = 400, body = crate::api::ErrorResponse), (status = 401, body = crate::api::ErrorResponse), (status = 404, body = crate::api::ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn get_version(
    State(state): State<AppState>,
    Path((name, version)): Path<(String, i64)>,
) -> ApiResult<Json<ModelVersionView>> {
    Ok(Json(find(&state, &name, version).await?.into()))
}

/// Download a version's model file.
#[utoipa::path(
    get, path = "/api/v1/models/{name}/versions/{version}/download", tag = "models",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"), ("version" = i64, Path)),
    responses(
        (status = 200, description = "The Canopy IR file", content_type = "application/octet-stream", body = Vec<u8>),
        (status = 400, body = crate::api::ErrorResponse), (status = 401, body = crate::api::ErrorResponse), (status = 404, body = crate::api::ErrorResponse)
    ),
    security(("bearer" = []))
)]
pub async fn download_version(
    State(state): State<AppState>,
    Path((name, version)): Path<(String, i64)>,
) -> ApiResult<Response> {
    let row = find(&state, &name, version).await?;
    let blob = state.blobs.stream(&row.digest, 0).await?;
    state.metrics.bytes_sent.inc_by(blob.size);
    let signed = state
        .signing
        .model_signature(&state.db, &row.digest)
        .await
        .map_err(|error| ApiError::internal(canopy_term::error_chain(&error)))?;
    let delegation = signed.delegation.clone();
    let mut response = (
        [
            (header::CONTENT_TYPE, "application/octet-stream".to_string()),
            (header::CONTENT_LENGTH, blob.size.to_string()),
            (
                header::CONTENT_DISPOSITION,
                format!("attachment; filename=\"{name}-v{version}.canopy\""),
            ),
        ],
        [
            (
                canopy_protocol::model_sig::HEADER_MODEL_DIGEST,
                row.digest.clone(),
            ),
            (
                canopy_protocol::model_sig::HEADER_MODEL_SIGNATURE,
                signed.signature_hex,
            ),
            (canopy_protocol::model_sig::HEADER_MODEL_KEY, signed.key_hex),
        ],
        Body::from_stream(blob.stream),
    )
        .into_response();
    // An edge's own version: the cloud's leave for the edge's key.
    if let Some(value) = delegation.and_then(|json| json.parse().ok()) {
        response
            .headers_mut()
            .insert(canopy_protocol::model_sig::HEADER_MODEL_DELEGATION, value);
    }
    Ok(response)
}

/// A version's ancestry: which round produced it from which parent.
#[utoipa::path(
    get, path = "/api/v1/models/{name}/versions/{version}/lineage", tag = "models",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9_-][A-Za-z0-9._-]{0,63}$"), ("version" = i64, Path)),
    responses((status = 200, body = Lineage), (status = 400, body = crate::api::ErrorResponse), (status = 401, body = crate::api::ErrorResponse), (status = 404, body = crate::api::ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn lineage(
    State(state): State<AppState>,
    Path((name, version)): Path<(String, i64)>,
) -> ApiResult<Json<Lineage>> {
    let row = find(&state, &name, version).await?;
    let chain = models::lineage(&state.db, row.id, MAX_LINEAGE + 1).await?;
    let truncated = chain.len() > MAX_LINEAGE;
    Ok(Json(Lineage {
        chain: chain
            .into_iter()
            .take(MAX_LINEAGE)
            .map(Into::into)
            .collect(),
        truncated,
    }))
}
