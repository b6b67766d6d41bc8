//! `POST /device/v1/unenroll`: a device ends its own enrollment (an app
//! uninstalled, a user opting out). The server revokes the device's key,
//! as an operator's revoke does: no request signed with it is accepted
//! again, and it is never selected. A pending participation is the
//! round's business as before: it becomes a dropout at the deadline.

use axum::body::Body;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};

use super::auth::DeviceAuth;
use super::signed_json;
use crate::api::error::ApiResult;
use crate::state::AppState;
use crate::store::devices;

pub(super) async fn unenroll(
    State(state): State<AppState>,
    device: DeviceAuth,
    headers: HeaderMap,
    body: Body,
) -> ApiResult<StatusCode> {
    // The body is `{}`; reading it checks the signed digest, so a replayed
    // or altered request is refused like any other.
    let _: serde_json::Map<String, serde_json::Value> =
        signed_json(&state, &device, &headers, body).await?;
    devices::revoke(&state.db, device.device_id).await?;
    state.device_keys.forget(device.device_id);
    tracing::info!(device = device.device_id, "device unenrolled itself");
    Ok(StatusCode::NO_CONTENT)
}
