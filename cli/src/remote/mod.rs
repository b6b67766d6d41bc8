//! The admin REST API of a Canopy server (`/api/v1`), as the logged-in
//! user: the saved login (`config`), requests with bounded answers, and
//! errors that name the object, the cause and what to do.
//!
//! The connection is the SDK's [`Transport`], so certificate pinning and
//! its timeouts have one home for devices and for this tool.

pub mod config;
pub mod table;

use std::fmt::Display;

use anyhow::{Context, Result, anyhow};
use canopy_protocol::messages::ErrorBody;
use canopy_sdk::{ConnectProblem, Transport};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use crate::files::Hint;
pub use config::Login;

/// Most bytes of a JSON answer read. The largest is a page of rounds with
/// their metrics and first participants: well under a megabyte at the
/// page size asked for.
pub const MAX_JSON_ANSWER_BYTES: usize = 16 << 20;
/// Items asked for per page; the server caps rounds at 100 a page.
pub const PAGE_SIZE: u32 = 100;
/// Pages a listing follows before it stops (and says so).
pub const MAX_LIST_PAGES: usize = 100;

/// What a request is about, for its error messages.
#[derive(Clone, Debug)]
pub struct Subject {
    /// `job 42`, `model digits`.
    pub name: String,
    /// The command that lists objects of its kind, hinted when it is not found.
    pub list_hint: Option<String>,
    /// What to do when it is not in a state the request applies to (409).
    pub conflict_hint: Option<String>,
    /// What a 404 means is missing, when that is not `name`: creating a
    /// job finds no model version, not no job.
    pub missing: Option<String>,
}

impl Subject {
    pub fn new(name: impl Into<String>, list_command: Option<&str>) -> Subject {
        Subject {
            name: name.into(),
            list_hint: list_command.map(list_hint),
            conflict_hint: None,
            missing: None,
        }
    }

    /// The same subject, whose 404 says `missing` does not exist, with
    /// `list_command` as the place to look.
    pub fn missing(mut self, missing: impl Into<String>, list_command: &str) -> Subject {
        self.missing = Some(missing.into());
        self.list_hint = Some(list_hint(list_command));
        self
    }

    pub fn job(id: i64) -> Subject {
        Subject {
            conflict_hint: Some(format!("see its state with `canopy job show {id}`")),
            ..Subject::new(format!("job {id}"), Some("canopy job ls"))
        }
    }
}

fn list_hint(list_command: &str) -> String {
    format!("see what exists with `{list_command}`")
}

/// What a request sends.
pub enum Payload {
    Empty,
    Json(Value),
    Bytes {
        bytes: Vec<u8>,
        content_type: &'static str,
    },
    Form(reqwest::multipart::Form),
}

/// The error of a request that got no answer, as a type, so that callers
/// that wait out a restart (`canopy job watch`) can tell it from a refusal.
#[derive(Debug)]
pub struct Unreachable {
    pub url: String,
}

impl Display for Unreachable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "cannot reach the Canopy server at {}", self.url)
    }
}

impl Unreachable {
    pub fn is(error: &anyhow::Error) -> bool {
        error.downcast_ref::<Unreachable>().is_some()
    }
}

/// A logged-in connection to one server.
pub struct Remote {
    transport: Transport,
    login: Login,
}

impl Remote {
    /// From the saved login (`canopy login`).
    pub fn from_saved() -> Result<Remote> {
        Remote::new(config::load()?)
    }

    pub fn new(login: Login) -> Result<Remote> {
        let transport = Transport::new(&login.url, &login.trust())
            .with_context(|| format!("cannot connect to `{}`", login.url))
            .map_err(|error| {
                Hint::attach(
                    error,
                    "the URL looks like https://HOST:PORT, and a fingerprint like sha256:<64 hex digits>",
                )
            })?;
        Ok(Remote { transport, login })
    }

    pub fn url(&self) -> &str {
        &self.login.url
    }

    /// The request `call` sends, before it is sent.
    pub fn request(&self, method: Method, path: &str, payload: Payload) -> reqwest::RequestBuilder {
        let request = self
            .transport
            .http()
            .request(method, self.transport.url(path))
            .bearer_auth(&self.login.token);
        match payload {
            Payload::Empty => request,
            Payload::Json(body) => request.json(&body),
            Payload::Bytes {
                bytes,
                content_type,
            } => request
                .header(reqwest::header::CONTENT_TYPE, content_type)
                .body(bytes),
            Payload::Form(form) => request.multipart(form),
        }
    }

    /// Sends a request and reads its JSON answer; a refusal becomes an
    /// error about `subject`.
    pub async fn call(
        &self,
        method: Method,
        path: &str,
        payload: Payload,
        subject: &Subject,
    ) -> Result<Value> {
        let mut response = self
            .request(method, path, payload)
            .send()
            .await
            .map_err(|error| self.unreachable(error))?;
        let status = response.status();
        let body = read_limited(&mut response, MAX_JSON_ANSWER_BYTES)
            .await
            .map_err(|error| self.unreachable(error))?;
        let Some(body) = body else {
            return Err(anyhow!(
                "the answer of {} about {} is over {MAX_JSON_ANSWER_BYTES} bytes",
                self.url(),
                subject.name
            ));
        };
        if !status.is_success() {
            return Err(self.refusal(status, &body, subject));
        }
        if body.is_empty() {
            return Ok(Value::Null);
        }
        serde_json::from_slice(&body).with_context(|| {
            format!(
                "the answer of {} about {} is not JSON",
                self.url(),
                subject.name
            )
        })
    }

    pub async fn get(&self, path: &str, subject: &Subject) -> Result<Value> {
        self.call(Method::GET, path, Payload::Empty, subject).await
    }

    pub async fn post(&self, path: &str, body: Value, subject: &Subject) -> Result<Value> {
        self.call(Method::POST, path, Payload::Json(body), subject)
            .await
    }

    /// Every item of a paginated listing (`items`, `next_cursor`), up to
    /// [`MAX_LIST_PAGES`] pages.
    pub async fn list_all(&self, path: &str, subject: &Subject) -> Result<Vec<Value>> {
        let separator = if path.contains('?') { '&' } else { '?' };
        let mut items = Vec::new();
        let mut cursor: Option<String> = None;
        for _ in 0..MAX_LIST_PAGES {
            let page_path = match &cursor {
                None => format!("{path}{separator}limit={PAGE_SIZE}"),
                Some(cursor) => format!("{path}{separator}limit={PAGE_SIZE}&cursor={cursor}"),
            };
            let mut page = self.get(&page_path, subject).await?;
            if let Some(page_items) = page.get_mut("items").and_then(Value::as_array_mut) {
                items.append(page_items);
            }
            cursor = match page["next_cursor"].as_str() {
                None => return Ok(items),
                Some(next) if is_url_safe(next) => Some(next.to_string()),
                Some(next) => {
                    return Err(anyhow!(
                        "{} sent a page cursor that is not URL-safe: {:?}",
                        self.url(),
                        next.chars().take(80).collect::<String>()
                    ));
                }
            };
        }
        crate::output::errln!(
            "warning: listed the first {} {} only ({MAX_LIST_PAGES} pages)",
            items.len(),
            subject.name
        );
        Ok(items)
    }

    /// A request that never got an answer: from a server that is there
    /// but cannot be talked to as asked (HTTPS spoken to an `http://` URL,
    /// an untrusted certificate), or from no server at all
    /// ([`Unreachable`], which `job watch` waits out).
    fn unreachable(&self, error: reqwest::Error) -> anyhow::Error {
        let url = self.url();
        if let Some(problem) = ConnectProblem::of(&error, url) {
            return Hint::attach(anyhow::Error::new(error), problem.hint(url)).context(format!(
                "cannot talk to the Canopy server at {url}: {problem}"
            ));
        }
        let hint = if error.is_timeout() {
            format!(
                "the server did not answer within {} s; check that it is healthy ({}/readyz)",
                canopy_sdk::REQUEST_TIMEOUT_MS / 1000,
                self.url()
            )
        } else {
            format!(
                "check that the server is running and listening at {}, or log in to another with `canopy login URL --token T`",
                self.url()
            )
        };
        Hint::attach(anyhow::Error::new(error), hint).context(Unreachable {
            url: self.url().to_string(),
        })
    }

    /// A request the server answered with an error status.
    fn refusal(&self, status: StatusCode, body: &[u8], subject: &Subject) -> anyhow::Error {
        let (code, message) = match serde_json::from_slice::<ErrorBody>(body) {
            Ok(error) => (error.error.code, error.error.message),
            Err(_) => (
                "unknown".to_string(),
                String::from_utf8_lossy(body).chars().take(500).collect(),
            ),
        };
        let cause = format!("{} {code}: {message}", status.as_u16());
        let url = self.url();
        let (top, hint): (String, Option<String>) = match status {
            StatusCode::UNAUTHORIZED => (
                format!("the server at {url} refused the token"),
                Some(format!(
                    "the token is unknown, expired or revoked: get a new one (`canopy-server token create --role operator`) and run `canopy login {url} --token T`"
                )),
            ),
            StatusCode::FORBIDDEN => (
                format!("the token may not do this to {}", subject.name),
                Some("log in with a token of the role the server names".to_string()),
            ),
            StatusCode::NOT_FOUND => (
                format!(
                    "{} does not exist on {url}",
                    subject.missing.as_deref().unwrap_or(&subject.name)
                ),
                subject.list_hint.clone(),
            ),
            StatusCode::CONFLICT => (
                format!("the server at {url} refused {}", subject.name),
                subject.conflict_hint.clone(),
            ),
            StatusCode::PAYLOAD_TOO_LARGE => (
                format!("the server at {url} refused {}: too large", subject.name),
                Some("the server's size limits are in its docs/limits.md".to_string()),
            ),
            StatusCode::TOO_MANY_REQUESTS | StatusCode::SERVICE_UNAVAILABLE => (
                format!("the server at {url} is busy"),
                Some("try again in a few seconds".to_string()),
            ),
            status if status.is_server_error() => (
                format!("the server at {url} failed while handling {}", subject.name),
                Some("its log names the cause under the request id".to_string()),
            ),
            _ => (
                format!("the server at {url} refused {}", subject.name),
                None,
            ),
        };
        let error = anyhow!(cause).context(top);
        match hint {
            Some(hint) => Hint::attach(error, hint),
            None => error,
        }
    }
}

/// Cursors the server issues are ids and model names.
fn is_url_safe(text: &str) -> bool {
    !text.is_empty()
        && text
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.'))
}

/// Reads a body of at most `limit_bytes`; `None` when it is longer. An
/// announced length over the limit is refused before reading.
async fn read_limited(
    response: &mut reqwest::Response,
    limit_bytes: usize,
) -> Result<Option<Vec<u8>>, reqwest::Error> {
    if response
        .content_length()
        .is_some_and(|length| length > limit_bytes as u64)
    {
        return Ok(None);
    }
    let mut body = Vec::new();
    while let Some(chunk) = response.chunk().await? {
        if body.len() + chunk.len() > limit_bytes {
            return Ok(None);
        }
        body.extend_from_slice(&chunk);
    }
    Ok(Some(body))
}

/// Runs an admin command on a runtime of its own: the tool is otherwise
/// synchronous, and one request at a time needs no more than one thread.
pub fn block_on<T>(future: impl std::future::Future<Output = Result<T>>) -> Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?
        .block_on(future)
}

/// A JSON value as a table cell: `-` for null, numbers with `digits`
/// decimals when fractional.
pub fn cell(value: &Value, digits: usize) -> String {
    match value {
        Value::Null => "-".to_string(),
        Value::String(text) => text.clone(),
        Value::Number(number) if number.is_f64() => {
            format!("{:.digits$}", number.as_f64().unwrap_or_default())
        }
        other => other.to_string(),
    }
}

/// Milliseconds since the Unix epoch as `12s ago`, `5m ago`, `3h ago`, `2d ago`.
pub fn ago(unix_ms: Option<i64>) -> String {
    let Some(unix_ms) = unix_ms else {
        return "-".to_string();
    };
    let now_ms = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_millis() as i64)
        .unwrap_or_default();
    let seconds = (now_ms - unix_ms).max(0) / 1000;
    match seconds {
        0..60 => format!("{seconds}s ago"),
        60..3600 => format!("{}m ago", seconds / 60),
        3600..86_400 => format!("{}h ago", seconds / 3600),
        _ => format!("{}d ago", seconds / 86_400),
    }
}

/// Prints a JSON value for `--json`.
pub fn print_json(value: &impl serde::Serialize) -> Result<()> {
    let text = serde_json::to_string_pretty(value)?;
    crate::output::outln!("{text}")?;
    Ok(())
}

/// A short digest for tables.
pub fn short(text: &str, chars: usize) -> impl Display + '_ {
    text.get(..chars).unwrap_or(text)
}
