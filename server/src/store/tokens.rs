//! Admin API tokens and device enrollment tokens.

use crate::store::row::any_row;
use canopy_protocol::messages::DeviceRole;
use serde::{Deserialize, Serialize};

use super::{Page, new_secret, secret_hash};
use crate::db::{Db, now_ms};

pub const API_TOKEN_PREFIX: &str = "cnpa_";
pub const ENROLLMENT_TOKEN_PREFIX: &str = "cnpe_";

/// What a token may do; each role includes the ones below it.
#[derive(
    Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize, utoipa::ToSchema,
)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    /// Reads everything except tokens.
    Viewer,
    /// Also writes models, jobs, devices and enrollment tokens.
    Operator,
    /// Also manages API tokens.
    Admin,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Viewer => "viewer",
            Role::Operator => "operator",
            Role::Admin => "admin",
        }
    }
}

impl std::str::FromStr for Role {
    type Err = String;
    fn from_str(text: &str) -> Result<Role, String> {
        match text {
            "viewer" => Ok(Role::Viewer),
            "operator" => Ok(Role::Operator),
            "admin" => Ok(Role::Admin),
            other => Err(format!(
                "unknown role `{other}`; expected admin, operator or viewer"
            )),
        }
    }
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct ApiTokenRow {
        pub id: i64,
        pub role: String,
        pub label: String,
        pub created_ms: i64,
        pub expires_ms: Option<i64>,
        pub revoked_ms: Option<i64>,
    }
}

/// Whether a token can be used now. The rule is [`TokenState::at`]'s,
/// and [`authenticate`]'s query applies the same one in SQL.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, utoipa::ToSchema)]
#[serde(rename_all = "lowercase")]
pub enum TokenState {
    /// Unrevoked and unexpired: it authenticates.
    Active,
    /// Past its `expires_ms`; it no longer authenticates.
    Expired,
    /// Revoked (whether or not it has also expired).
    Revoked,
}

impl TokenState {
    /// A token's state at `now_ms`: revocation first, then expiry (a
    /// token is valid strictly before `expires_ms`).
    pub fn at(revoked_ms: Option<i64>, expires_ms: Option<i64>, now_ms: i64) -> TokenState {
        match (revoked_ms, expires_ms) {
            (Some(_), _) => TokenState::Revoked,
            (None, Some(expires)) if expires <= now_ms => TokenState::Expired,
            (None, _) => TokenState::Active,
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            TokenState::Active => "active",
            TokenState::Expired => "expired",
            TokenState::Revoked => "revoked",
        }
    }
}

impl std::fmt::Display for TokenState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // `pad`, so that a table's `{:<7}` aligns it.
        f.pad(self.as_str())
    }
}

impl ApiTokenRow {
    pub fn state(&self, now_ms: i64) -> TokenState {
        TokenState::at(self.revoked_ms, self.expires_ms, now_ms)
    }
}

/// A token that is valid now, as the auth layer sees it.
#[derive(Clone, Copy, Debug)]
pub struct Principal {
    pub token_id: i64,
    pub role: Role,
}

pub async fn create_api_token(
    db: &Db,
    role: Role,
    label: &str,
    expires_ms: Option<i64>,
) -> Result<(ApiTokenRow, String), sqlx::Error> {
    let secret = new_secret(API_TOKEN_PREFIX);
    let row: ApiTokenRow = sqlx::query_as(
        "INSERT INTO api_tokens (role, label, token_hash, created_ms, expires_ms) \
         VALUES ($1, $2, $3, $4, $5) \
         RETURNING id, role, label, created_ms, expires_ms, revoked_ms",
    )
    .bind(role.as_str())
    .bind(label)
    .bind(secret_hash(&secret))
    .bind(now_ms())
    .bind(expires_ms)
    .fetch_one(&db.pool)
    .await?;
    Ok((row, secret))
}

/// The principal behind a bearer secret, if it is known, unexpired and
/// unrevoked: [`TokenState::Active`], as [`TokenState::at`] decides it.
pub async fn authenticate(db: &Db, secret: &str) -> Result<Option<Principal>, sqlx::Error> {
    let row: Option<(i64, String)> = sqlx::query_as(
        "SELECT id, role FROM api_tokens WHERE token_hash = $1 AND revoked_ms IS NULL \
         AND (expires_ms IS NULL OR expires_ms > $2)",
    )
    .bind(secret_hash(secret))
    .bind(now_ms())
    .fetch_optional(&db.pool)
    .await?;
    Ok(row.and_then(|(token_id, role)| role.parse().ok().map(|role| Principal { token_id, role })))
}

pub async fn list_api_tokens(db: &Db, page: Page) -> Result<Vec<ApiTokenRow>, sqlx::Error> {
    sqlx::query_as(
        "SELECT id, role, label, created_ms, expires_ms, revoked_ms FROM api_tokens \
         WHERE id > $1 ORDER BY id LIMIT $2",
    )
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

/// Revokes a token; false when no such token exists.
pub async fn revoke_api_token(db: &Db, id: i64) -> Result<bool, sqlx::Error> {
    let result =
        sqlx::query("UPDATE api_tokens SET revoked_ms = COALESCE(revoked_ms, $1) WHERE id = $2")
            .bind(now_ms())
            .bind(id)
            .execute(&db.pool)
            .await?;
    Ok(result.rows_affected() == 1)
}

any_row! {
    #[derive(Clone, Debug)]
    pub struct EnrollmentTokenRow {
        pub id: i64,
        pub label: String,
        pub created_ms: i64,
        pub expires_ms: i64,
        pub max_uses: i64,
        pub uses: i64,
        pub revoked_ms: Option<i64>,
        /// The role it enrolls devices in (`DeviceRole`'s name).
        pub device_role: String,
    }
}

impl EnrollmentTokenRow {
    pub fn device_role(&self) -> Result<DeviceRole, sqlx::Error> {
        self.device_role
            .parse()
            .map_err(|error: String| sqlx::Error::Decode(error.into()))
    }
}

const ENROLLMENT_COLUMNS: &str =
    "id, label, created_ms, expires_ms, max_uses, uses, revoked_ms, device_role";

/// What an enrollment token is made with.
pub struct NewEnrollmentToken<'a> {
    pub label: &'a str,
    pub expires_ms: i64,
    pub max_uses: i64,
    pub device_role: DeviceRole,
}

pub async fn create_enrollment_token(
    db: &Db,
    new: &NewEnrollmentToken<'_>,
) -> Result<(EnrollmentTokenRow, String), sqlx::Error> {
    let secret = new_secret(ENROLLMENT_TOKEN_PREFIX);
    let row = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "INSERT INTO enrollment_tokens \
         (label, token_hash, created_ms, expires_ms, max_uses, device_role) \
         VALUES ($1, $2, $3, $4, $5, $6) RETURNING {ENROLLMENT_COLUMNS}"
    )))
    .bind(new.label)
    .bind(secret_hash(&secret))
    .bind(now_ms())
    .bind(new.expires_ms)
    .bind(new.max_uses)
    .bind(new.device_role.as_str())
    .fetch_one(&db.pool)
    .await?;
    Ok((row, secret))
}

pub async fn list_enrollment_tokens(
    db: &Db,
    page: Page,
) -> Result<Vec<EnrollmentTokenRow>, sqlx::Error> {
    sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ENROLLMENT_COLUMNS} FROM enrollment_tokens WHERE id > $1 ORDER BY id LIMIT $2"
    )))
    .bind(page.after)
    .bind(page.limit)
    .fetch_all(&db.pool)
    .await
}

pub async fn revoke_enrollment_token(db: &Db, id: i64) -> Result<bool, sqlx::Error> {
    let result = sqlx::query(
        "UPDATE enrollment_tokens SET revoked_ms = COALESCE(revoked_ms, $1) WHERE id = $2",
    )
    .bind(now_ms())
    .bind(id)
    .execute(&db.pool)
    .await?;
    Ok(result.rows_affected() == 1)
}

/// Why an enrollment token cannot be used.
#[derive(Debug, thiserror::Error)]
pub enum EnrollmentTokenError {
    #[error("the enrollment token is not known to this server")]
    Unknown,
    #[error("enrollment token {id} was revoked")]
    Revoked { id: i64 },
    #[error("enrollment token {id} expired")]
    Expired { id: i64 },
    #[error("enrollment token {id} has been used {uses} times, its limit")]
    Exhausted { id: i64, uses: i64 },
    #[error(
        "enrollment token {id} enrolls {token_role}s, and this device asked to enroll as \
         {requested}; ask for a token of that role \
         (`canopy device enroll-token --role {requested}`)"
    )]
    WrongRole {
        id: i64,
        token_role: DeviceRole,
        requested: DeviceRole,
    },
    #[error(transparent)]
    Sql(#[from] sqlx::Error),
}

/// Spends one use of an enrollment token inside `tx`, checking it is valid
/// and enrolls devices in the `requested` role.
pub async fn spend_enrollment_token(
    tx: &mut sqlx::Transaction<'_, sqlx::Any>,
    secret: &str,
    requested: DeviceRole,
) -> Result<i64, EnrollmentTokenError> {
    let row: Option<EnrollmentTokenRow> = sqlx::query_as(sqlx::AssertSqlSafe(format!(
        "SELECT {ENROLLMENT_COLUMNS} FROM enrollment_tokens WHERE token_hash = $1"
    )))
    .bind(secret_hash(secret))
    .fetch_optional(&mut **tx)
    .await?;
    let token = row.ok_or(EnrollmentTokenError::Unknown)?;
    if token.revoked_ms.is_some() {
        return Err(EnrollmentTokenError::Revoked { id: token.id });
    }
    if token.expires_ms <= now_ms() {
        return Err(EnrollmentTokenError::Expired { id: token.id });
    }
    let token_role = token.device_role()?;
    if token_role != requested {
        return Err(EnrollmentTokenError::WrongRole {
            id: token.id,
            token_role,
            requested,
        });
    }
    // The guard in the WHERE clause keeps the limit under concurrent use.
    let spent = sqlx::query(
        "UPDATE enrollment_tokens SET uses = uses + 1 WHERE id = $1 AND uses < max_uses",
    )
    .bind(token.id)
    .execute(&mut **tx)
    .await?;
    if spent.rows_affected() != 1 {
        return Err(EnrollmentTokenError::Exhausted {
            id: token.id,
            uses: token.uses,
        });
    }
    Ok(token.id)
}

#[cfg(test)]
mod tests {
    use super::TokenState;

    #[test]
    fn a_token_expires_at_its_expiry_and_revocation_wins() {
        assert_eq!(TokenState::at(None, None, 5), TokenState::Active);
        assert_eq!(TokenState::at(None, Some(6), 5), TokenState::Active);
        assert_eq!(TokenState::at(None, Some(5), 5), TokenState::Expired);
        assert_eq!(TokenState::at(Some(1), Some(4), 5), TokenState::Revoked);
        assert_eq!(TokenState::at(Some(1), None, 5), TokenState::Revoked);
    }
}
