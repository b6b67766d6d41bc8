//! Held-out datasets for central evaluation: upload, list, get, delete.

use axum::extract::State;
use axum::extract::multipart::{Multipart, MultipartRejection};
use axum::http::{HeaderMap, StatusCode};
use canopy_engine::data::Dataset;
use serde::Serialize;
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use utoipa::ToSchema;

use crate::api::ErrorResponse;
use crate::api::admin::models::{content_length, staging_dir};
use crate::api::error::{ApiError, ApiResult, Json, Path};
use crate::api::{upload_slot, within_upload_timeout};
use crate::datasets::{self as parsing, DATA_PART, LABELS_PART, ParseError, Staged};
use crate::state::AppState;
use crate::store::datasets::{self, DatasetKind, DatasetRow, Inserted, NewDataset};
use canopy_term::error_chain as chain;

/// The pattern the document states for a dataset name (written out in
/// each route's attributes); a test keeps it equal to
/// `datasets::check_new_name`.
#[cfg(test)]
pub(crate) const NAME_PATTERN: &str = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$";

#[derive(Debug, Serialize, ToSchema)]
pub struct DatasetView {
    pub name: String,
    /// The format it was uploaded in, told from its bytes.
    pub kind: DatasetKind,
    pub samples: i64,
    /// The shape of one sample as loaded (IDX images are `[1, H, W]`); a
    /// job's model must take samples of the same number of values.
    pub sample_shape: Vec<u64>,
    pub classes: i64,
    /// Bytes stored: the data part, then the labels part.
    pub size_bytes: i64,
    /// SHA-256 (hex) of the stored bytes.
    pub digest: String,
    pub created_unix_ms: i64,
}

impl DatasetView {
    fn from_row(row: DatasetRow) -> ApiResult<DatasetView> {
        Ok(DatasetView {
            sample_shape: row.sample_shape()?,
            name: row.name,
            kind: row.kind,
            samples: row.samples,
            classes: row.classes,
            size_bytes: row.size_bytes,
            digest: row.digest,
            created_unix_ms: row.created_unix_ms,
        })
    }
}

#[derive(Debug, Serialize, ToSchema)]
pub struct DatasetList {
    pub datasets: Vec<DatasetView>,
}

/// The multipart body of an upload, for the OpenAPI document.
#[derive(ToSchema)]
#[allow(dead_code)]
pub struct DatasetUpload {
    /// A CSV file (label in the last column, header detected), an IDX
    /// images file or an NPY images array; gzipped or not.
    #[schema(value_type = String, content_media_type = "application/octet-stream")]
    data: Vec<u8>,
    /// The labels file of IDX and NPY images (IDX or NPY); none for CSV.
    #[schema(value_type = Option<String>, content_media_type = "application/octet-stream")]
    labels: Option<Vec<u8>>,
}

/// A refusal that names the dataset, the cause and what to do.
fn refusal(name: &str, cause: impl std::fmt::Display, hint: &str) -> String {
    format!("dataset `{name}`: {cause}; hint: {hint}")
}

/// A new dataset's name, by the one rule (`datasets::check_new_name`).
fn check_new_name(name: &str) -> ApiResult<()> {
    parsing::check_new_name(name).map_err(|cause| {
        ApiError::unprocessable(format!(
            "{cause}; hint: start it with a letter or digit, then letters, digits, `_`, `.` or `-`"
        ))
    })
}

/// A name to look up: any a dataset may have been stored under, including
/// names older servers took that `check_new_name` now refuses, so they
/// can still be read and deleted.
fn check_stored_name(name: &str) -> ApiResult<()> {
    canopy_protocol::messages::check_dataset_name("dataset name", name).map_err(|cause| {
        ApiError::bad_request(format!(
            "{cause}; hint: list the datasets with GET /api/v1/datasets"
        ))
    })
}

/// Upload a held-out dataset for central evaluation.
#[utoipa::path(
    put, path = "/api/v1/datasets/{name}", tag = "datasets",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$", description = "Dataset name: 1 to 64 letters, digits, `_`, `.` or `-`, starting with a letter or digit")),
    request_body(content = inline(DatasetUpload), content_type = "multipart/form-data",
        description = "Part `data`: a CSV file (label in the last column), an IDX images file or an NPY images array, gzipped or not; part `labels`: the labels of IDX or NPY images. The format is told from the bytes."),
    responses(
        (status = 201, description = "Stored", body = DatasetView),
        (status = 400, description = "Bad body", body = ErrorResponse),
        (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
        (status = 409, description = "The name is taken, or the server holds its most datasets", body = ErrorResponse),
        (status = 413, description = "Over the upload size limit, or its parts decompress past it, or hold more values than the server takes", body = ErrorResponse),
        (status = 422, description = "A name the rule refuses, or not a dataset the server can read", body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn upload(
    State(state): State<AppState>,
    Path(name): Path<String>,
    headers: HeaderMap,
    multipart: Result<Multipart, MultipartRejection>,
) -> ApiResult<(StatusCode, Json<DatasetView>)> {
    check_new_name(&name)?;
    let limit = state.settings.limits.max_dataset_bytes;
    if let Some(length) = content_length(&headers).filter(|&length| length > limit) {
        return Err(too_large(&name, length, limit));
    }
    refuse_taken(&state, &name).await?;
    let multipart = multipart.map_err(|rejection| {
        ApiError::bad_request(refusal(
            &name,
            format_args!("the body is not multipart/form-data ({})", rejection.body_text()),
            "send the file as part `data` (and its labels as part `labels`) of a multipart/form-data body",
        ))
    })?;
    let _slot = upload_slot(&state, &state.model_upload_slots, None).await?;
    let staged =
        within_upload_timeout(&state, "dataset upload", receive(&state, &name, multipart)).await?;
    // Parsing holds the file and its samples in memory: one at a time, as
    // model files are verified.
    let _parsing = state
        .model_verification
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    let bounds = parsing::bounds(&state.settings.limits);
    let (staged, parsed) = tokio::task::spawn_blocking(move || {
        let parsed = staged.parse(&bounds);
        (staged, parsed)
    })
    .await
    .map_err(|error| ApiError::internal(format!("the dataset parse task failed: {error}")))?;
    let (kind, dataset) = parsed.map_err(|error| parse_refusal(&name, error))?;
    let row = store(&state, &name, &staged, kind, dataset).await?;
    tracing::info!(dataset = %name, kind = %row.kind, samples = row.samples, digest = %row.digest, "stored dataset");
    Ok((StatusCode::CREATED, Json(DatasetView::from_row(row)?)))
}

fn too_large(name: &str, size: u64, limit: u64) -> ApiError {
    ApiError::too_large(refusal(
        name,
        format_args!("the upload is at least {size} bytes, over the {limit}-byte limit"),
        "upload a smaller held-out split, or raise limits.max_dataset_bytes in the server's config",
    ))
}

async fn refuse_taken(state: &AppState, name: &str) -> ApiResult<()> {
    if datasets::get(&state.db, name).await?.is_some() {
        return Err(ApiError::conflict(refusal(
            name,
            "a dataset of that name exists",
            &format!("delete it first (DELETE /api/v1/datasets/{name}), or choose another name"),
        )));
    }
    Ok(())
}

fn parse_refusal(name: &str, error: ParseError) -> ApiError {
    let hint = match &error {
        ParseError::Io(_) => {
            return ApiError::internal(format!("dataset `{name}`: {}", chain(&error)));
        }
        ParseError::MissingLabels { .. } => "add the labels file as part `labels`",
        ParseError::UnexpectedLabels => "send the CSV file alone, as part `data`",
        ParseError::Empty => "upload a dataset with at least one sample",
        ParseError::TooManySamples { .. } => "upload a smaller held-out split",
        ParseError::OverBound { over, .. } => {
            let hint = format!(
                "upload a smaller held-out split, or raise {} in the server's config",
                parsing::setting(over)
            );
            return ApiError::too_large(refusal(name, &error, &hint));
        }
        ParseError::Invalid { .. } => {
            "send a CSV file (label in the last column), or IDX or NPY images as `data` with their labels as `labels`"
        }
    };
    ApiError::unprocessable(refusal(name, &error, hint))
}

/// Streams the parts to staged files as they arrive, counting every byte
/// against `limits.max_dataset_bytes` (the parse counts them again as
/// they decompress).
async fn receive(state: &AppState, name: &str, mut multipart: Multipart) -> ApiResult<Staged> {
    let limit = state.settings.limits.max_dataset_bytes;
    let dir = staging_dir(state);
    let io_error = |error: std::io::Error| {
        ApiError::internal(format!(
            "cannot stage dataset `{name}` in {}: {error}",
            dir.display()
        ))
    };
    let mut staged = Staged::new_in(&dir).map_err(io_error)?;
    let (mut received, mut has_data) = (0u64, false);
    let bad_body = |error: axum::extract::multipart::MultipartError| {
        ApiError::bad_request(refusal(
            name,
            format_args!("the multipart body cannot be read: {}", error.body_text()),
            "send a well-formed multipart/form-data body with parts `data` and `labels`",
        ))
    };
    while let Some(mut field) = multipart.next_field().await.map_err(bad_body)? {
        let part = field.name().unwrap_or_default().to_string();
        let (path, seen) = match part.as_str() {
            DATA_PART => (staged.data(), &mut has_data),
            LABELS_PART => (staged.labels(), &mut staged.has_labels),
            other => {
                return Err(ApiError::bad_request(refusal(
                    name,
                    format_args!("the body has a part named `{}`", truncate(other)),
                    "send only the parts `data` and, for IDX or NPY images, `labels`",
                )));
            }
        };
        if std::mem::replace(seen, true) {
            return Err(ApiError::bad_request(refusal(
                name,
                format_args!("the body has two `{part}` parts"),
                "send each part once",
            )));
        }
        let mut file = tokio::fs::File::create(&path).await.map_err(io_error)?;
        while let Some(chunk) = field.chunk().await.map_err(bad_body)? {
            received += chunk.len() as u64;
            if received > limit {
                return Err(too_large(name, received, limit));
            }
            file.write_all(&chunk).await.map_err(io_error)?;
        }
        file.flush().await.map_err(io_error)?;
    }
    if !has_data {
        return Err(ApiError::bad_request(refusal(
            name,
            "the body has no `data` part",
            "send the dataset file as part `data`",
        )));
    }
    Ok(staged)
}

fn truncate(text: &str) -> String {
    text.chars().take(64).collect()
}

/// Stores the parts as one blob (data, then labels) and records the row.
/// The parsed dataset is dropped first: only its sizes are kept, so the
/// upload holds its values or its bytes, never both (docs/limits.md).
async fn store(
    state: &AppState,
    name: &str,
    staged: &Staged,
    kind: DatasetKind,
    dataset: Dataset,
) -> ApiResult<DatasetRow> {
    let sample_shape: Vec<u64> = dataset.feature_shape().iter().map(|&d| d as u64).collect();
    let (samples, classes) = (dataset.len() as u64, dataset.num_classes() as u64);
    drop(dataset);
    let read_error = |error: std::io::Error| {
        ApiError::internal(format!("cannot read the staged dataset `{name}`: {error}"))
    };
    let mut bytes = tokio::fs::read(staged.data()).await.map_err(read_error)?;
    let data_bytes = bytes.len() as u64;
    if staged.has_labels {
        let mut labels = tokio::fs::File::open(staged.labels())
            .await
            .map_err(read_error)?;
        let len = labels.metadata().await.map_err(read_error)?.len();
        bytes.reserve_exact(usize::try_from(len).unwrap_or(0));
        labels.read_to_end(&mut bytes).await.map_err(read_error)?;
    }
    let digest = hex::encode(Sha256::digest(&bytes));
    let size_bytes = bytes.len() as u64;
    state.blobs.put(&digest, bytes.into()).await?;
    let new = NewDataset {
        name,
        kind,
        samples,
        sample_shape: &sample_shape,
        classes,
        size_bytes,
        data_bytes,
        digest: &digest,
    };
    let max = state.settings.limits.max_datasets;
    match datasets::insert(&state.db, &new, max).await? {
        Inserted::Stored(row) => Ok(*row),
        Inserted::Exists => Err(refuse_taken(state, name).await.err().unwrap_or_else(|| {
            ApiError::conflict(refusal(
                name,
                "a dataset of that name was just deleted",
                "upload it again",
            ))
        })),
        Inserted::Full { max } => Err(ApiError::conflict(refusal(
            name,
            format_args!("the server holds {max} datasets, its limit (limits.max_datasets)"),
            "delete one you no longer need (DELETE /api/v1/datasets/NAME)",
        ))),
    }
}

/// List the datasets, by name.
#[utoipa::path(
    get, path = "/api/v1/datasets", tag = "datasets",
    responses((status = 200, body = DatasetList), (status = 401, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn list(State(state): State<AppState>) -> ApiResult<Json<DatasetList>> {
    let rows = datasets::list(&state.db).await?;
    Ok(Json(DatasetList {
        datasets: rows
            .into_iter()
            .map(DatasetView::from_row)
            .collect::<ApiResult<_>>()?,
    }))
}

async fn find(state: &AppState, name: &str) -> ApiResult<DatasetRow> {
    check_stored_name(name)?;
    datasets::get(&state.db, name).await?.ok_or_else(|| {
        ApiError::not_found(refusal(
            name,
            "no such dataset",
            "list them with GET /api/v1/datasets, or upload it with PUT",
        ))
    })
}

/// Get one dataset.
#[utoipa::path(
    get, path = "/api/v1/datasets/{name}", tag = "datasets",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")),
    responses((status = 200, body = DatasetView), (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 404, body = ErrorResponse)),
    security(("bearer" = []))
)]
pub async fn get(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<Json<DatasetView>> {
    Ok(Json(DatasetView::from_row(find(&state, &name).await?)?))
}

/// Delete a dataset no unfinished job evaluates on.
#[utoipa::path(
    delete, path = "/api/v1/datasets/{name}", tag = "datasets",
    params(("name" = String, Path, pattern = "^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")),
    responses(
        (status = 204, description = "Deleted"),
        (status = 400, body = ErrorResponse), (status = 401, body = ErrorResponse), (status = 403, body = ErrorResponse),
        (status = 404, body = ErrorResponse),
        (status = 409, description = "A job that has not finished evaluates on it", body = ErrorResponse),
    ),
    security(("bearer" = []))
)]
pub async fn delete(
    State(state): State<AppState>,
    Path(name): Path<String>,
) -> ApiResult<StatusCode> {
    find(&state, &name).await?;
    let jobs = datasets::unfinished_jobs_using(&state.db, &name).await?;
    if let Some(first) = jobs.first() {
        return Err(ApiError::conflict(refusal(
            &name,
            format_args!(
                "{} job(s) that have not finished evaluate on it (job {first}{})",
                jobs.len(),
                if jobs.len() > 1 { ", ..." } else { "" }
            ),
            "wait for them to finish, or cancel them (POST /api/v1/jobs/ID/cancel)",
        )));
    }
    if !datasets::delete(&state.db, &name).await? {
        return Err(find(&state, &name).await.err().unwrap_or_else(|| {
            ApiError::conflict(refusal(
                &name,
                "it changed while being deleted",
                "try again",
            ))
        }));
    }
    tracing::info!(dataset = %name, "deleted dataset");
    Ok(StatusCode::NO_CONTENT)
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_documented_pattern_is_the_name_rule() {
        let pattern = regex::Regex::new(super::NAME_PATTERN).expect("pattern");
        for name in [
            "digits",
            "a",
            "x.y-z_1",
            &"n".repeat(64),
            "",
            "a b",
            "é",
            &"n".repeat(65),
            "a/b",
            "..",
            ".hidden",
            "-rf",
            "_x",
            "9",
        ] {
            assert_eq!(
                pattern.is_match(name),
                crate::datasets::check_new_name(name).is_ok(),
                "{name:?}"
            );
        }
    }
}
