//! Queries, grouped by what they are about. Each function is one
//! statement or one transaction; callers never see SQL.

pub mod datasets;
pub mod devices;
pub mod evaluations;
pub mod jobs;
pub mod models;
pub mod relayed_signatures;
pub mod rounds;
pub(crate) mod row;
pub mod secagg;
pub mod settings;
pub mod signing_keys;
pub mod strategy;
pub mod task_state;
pub mod tokens;
pub mod uplinks;

use rand::RngCore;
use sha2::{Digest, Sha256};

/// A fresh secret: `prefix` plus 32 random bytes in hex. The prefix tells a
/// leaked secret's kind at a glance (and to secret scanners).
pub fn new_secret(prefix: &str) -> String {
    let mut bytes = [0u8; 32];
    rand::rng().fill_bytes(&mut bytes);
    format!("{prefix}{}", hex::encode(bytes))
}

/// Secrets are 256-bit random, so a plain SHA-256 is enough to store them:
/// there is no dictionary to slow down, unlike with passwords.
pub fn secret_hash(secret: &str) -> Vec<u8> {
    Sha256::digest(secret.as_bytes()).to_vec()
}

/// Cursor pagination: ids strictly after `after`, at most `limit`.
#[derive(Clone, Copy, Debug)]
pub struct Page {
    pub after: i64,
    pub limit: i64,
}

/// A stored state that names no variant: the database holds a value this
/// server never writes.
#[derive(Debug, thiserror::Error)]
#[error("`{text}` is not a {kind}; expected one of {}", expected.join(", "))]
pub struct UnknownState {
    pub kind: &'static str,
    pub text: String,
    pub expected: &'static [&'static str],
}

/// A state stored as text: the variant's lowercase name, the same in the
/// database and in the API. Rows decode it with `#[sqlx(try_from =
/// "String")]`, so an unknown value is an error at the store boundary, not a
/// string compared further in.
macro_rules! text_enum {
    (
        $(#[$meta:meta])*
        pub enum $name:ident { $($(#[$vmeta:meta])* $variant:ident = $text:literal),+ $(,)? }
    ) => {
        $(#[$meta])*
        #[derive(
            Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, serde::Serialize,
            serde::Deserialize, utoipa::ToSchema,
        )]
        // utoipa cannot read a rename given as a macro fragment, so the
        // schema takes its names from this; every variant's text must stay
        // its name in snake_case (Schemathesis checks the two).
        #[serde(rename_all = "snake_case")]
        pub enum $name {
            $($(#[$vmeta])* #[serde(rename = $text)] $variant),+
        }

        impl $name {
            pub const ALL: &'static [$name] = &[$($name::$variant),+];

            pub fn as_str(self) -> &'static str {
                match self {
                    $($name::$variant => $text),+
                }
            }

            pub fn parse(text: &str) -> Option<$name> {
                match text {
                    $($text => Some($name::$variant),)+
                    _ => None,
                }
            }
        }

        impl std::fmt::Display for $name {
            fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str(self.as_str())
            }
        }

        impl TryFrom<String> for $name {
            type Error = $crate::store::UnknownState;

            fn try_from(text: String) -> Result<$name, Self::Error> {
                $name::parse(&text).ok_or($crate::store::UnknownState {
                    kind: stringify!($name),
                    text,
                    expected: &[$($text),+],
                })
            }
        }
    };
}
pub(crate) use text_enum;

/// Unwraps a JSON column written by this server.
pub(crate) fn from_json<T: serde::de::DeserializeOwned>(
    column: &str,
    text: &str,
) -> Result<T, sqlx::Error> {
    serde_json::from_str(text).map_err(|error| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: Box::new(error),
    })
}

/// Parses a state column read on its own; rows parse theirs with
/// `#[sqlx(try_from = "String")]`, with the same error.
pub(crate) fn parse_state<T>(column: &str, text: String) -> Result<T, sqlx::Error>
where
    T: TryFrom<String, Error = UnknownState>,
{
    T::try_from(text).map_err(|error| sqlx::Error::ColumnDecode {
        index: column.to_string(),
        source: Box::new(error),
    })
}

#[cfg(test)]
mod tests {
    use super::jobs::JobState;
    use super::rounds::{ParticipantState, RoundState};
    use super::secagg::SecureStage;

    fn known(text: &str) -> bool {
        use super::evaluations::{CentralState, EvaluationState, EvaluatorState};
        EvaluatorState::parse(text).is_some()
            || CentralState::parse(text).is_some()
            || EvaluationState::parse(text).is_some()
            || JobState::parse(text).is_some()
            || RoundState::parse(text).is_some()
            || ParticipantState::parse(text).is_some()
            || SecureStage::parse(text).is_some()
    }

    #[test]
    fn states_round_trip_and_unknown_text_is_an_error() {
        for state in RoundState::ALL {
            assert_eq!(RoundState::try_from(state.to_string()).ok(), Some(*state));
        }
        for state in ParticipantState::ALL {
            assert_eq!(ParticipantState::parse(state.as_str()), Some(*state));
        }
        let error = RoundState::try_from("trainig".to_string()).unwrap_err();
        let message = error.to_string();
        assert!(
            message.contains("`trainig` is not a RoundState"),
            "{message}"
        );
        assert!(
            message.contains("selecting, training, aggregating"),
            "{message}"
        );
    }

    /// SQL writes states as literals; each must be a variant's text, or
    /// rows would hold a state no decoder accepts.
    #[test]
    fn every_state_written_in_sql_is_a_variant() {
        let sources = [
            include_str!("rounds.rs"),
            include_str!("secagg.rs"),
            include_str!("jobs.rs"),
            include_str!("evaluations.rs"),
            include_str!("datasets.rs"),
            include_str!("task_state.rs"),
        ];
        let pattern = regex::Regex::new(
            r"(?:state|stage) (?:=|IN) \(?'([a-z_]+)'|THEN '([a-z_]+)'|'([a-z_]+)', '([a-z_]+)'",
        )
        .expect("pattern");
        let mut seen = 0;
        for source in sources {
            for captures in pattern.captures_iter(source) {
                for text in captures.iter().skip(1).flatten() {
                    seen += 1;
                    assert!(known(text.as_str()), "`{}` is no state", text.as_str());
                }
            }
        }
        assert!(
            seen > 20,
            "only {seen} state literals found: the pattern is stale"
        );
    }
}
