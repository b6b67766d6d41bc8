//! Held-out datasets through a real server, on SQLite and PostgreSQL:
//! uploads in each format (CSV, IDX, NPY; gzipped or not) are told apart
//! by their bytes and parsed by the engine's loaders; names, sizes,
//! counts and malformed bodies are refused with errors that name the
//! dataset, the cause and a hint; a dataset a job evaluates on cannot be
//! deleted until the job has finished; jobs name only datasets that exist
//! and fit their model.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result, ensure};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::raw;
use crate::support;
use crate::support::{Admin, Database, Reply, TestServer, logreg_model_bytes};

pub fn digits_csv_gz() -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets/digits/digits.csv.gz");
    std::fs::read(path).expect("the bundled digits")
}

/// An IDX images file of `n` 8×8 images (u8), optionally cut short.
fn idx_images(n: u32) -> Vec<u8> {
    let mut bytes = vec![0, 0, 8, 3];
    for dim in [n, 8, 8] {
        bytes.extend(dim.to_be_bytes());
    }
    bytes.extend((0..n * 64).map(|i| (i * 7 % 256) as u8));
    bytes
}

fn idx_labels(n: u32) -> Vec<u8> {
    let mut bytes = vec![0, 0, 8, 1];
    bytes.extend(n.to_be_bytes());
    bytes.extend((0..n).map(|i| (i % 10) as u8));
    bytes
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    encoder.write_all(bytes).expect("gzip");
    encoder.finish().expect("gzip")
}

/// An NPY v1 array: `descr` and `shape` in the header, then `data`.
fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut bytes = b"\x93NUMPY\x01\x00".to_vec();
    bytes.extend((header.len() as u16).to_le_bytes());
    bytes.extend(header.as_bytes());
    bytes.extend(data);
    bytes
}

fn sha256_hex(bytes: &[u8]) -> String {
    hex::encode(Sha256::digest(bytes))
}

/// `PUT /api/v1/datasets/{name}` with the given multipart parts.
pub async fn put_dataset(admin: &Admin, name: &str, parts: &[(&str, Vec<u8>)]) -> Result<Reply> {
    let mut form = reqwest::multipart::Form::new();
    for (part, bytes) in parts {
        form = form.part(
            part.to_string(),
            reqwest::multipart::Part::bytes(bytes.clone()).file_name(part.to_string()),
        );
    }
    let response = admin
        .transport
        .http()
        .put(admin.transport.url(&format!("/api/v1/datasets/{name}")))
        .bearer_auth(&admin.token)
        .multipart(form)
        .send()
        .await?;
    let status = response.status().as_u16();
    let body = response.json().await.unwrap_or(Value::Null);
    Ok(Reply { status, body })
}

fn message(reply: &Reply) -> String {
    reply.body["error"]["message"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The refusal names the dataset, says what is wrong and gives a hint.
fn ensure_refused(reply: &Reply, status: u16, name: &str, cause: &str) -> Result<()> {
    let text = message(reply);
    ensure!(
        reply.status == status,
        "expected {status} for `{name}` ({cause}), got {}: {}",
        reply.status,
        reply.body
    );
    ensure!(
        text.contains(&format!("`{name}`")) && text.contains(cause) && text.contains("hint:"),
        "the refusal should name `{name}`, say `{cause}` and give a hint: {text}"
    );
    Ok(())
}

async fn upload_list_get_delete(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let csv = digits_csv_gz();
    let reply = put_dataset(&admin, "digits", &[("data", csv.clone())]).await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let digits = reply.body;
    ensure!(
        digits["name"] == "digits" && digits["kind"] == "csv",
        "{digits}"
    );
    ensure!(
        digits["samples"] == 1797 && digits["classes"] == 10,
        "{digits}"
    );
    ensure!(digits["sample_shape"] == json!([64]), "{digits}");
    ensure!(digits["size_bytes"] == csv.len() as u64, "{digits}");
    ensure!(digits["digest"] == sha256_hex(&csv), "{digits}");
    ensure!(
        digits["created_unix_ms"].as_i64().unwrap_or(0) > 0,
        "{digits}"
    );

    // IDX: gzipped images, plain labels; stored as one blob, data first.
    let (images, labels) = (gzip(&idx_images(20)), idx_labels(20));
    let reply = put_dataset(
        &admin,
        "idx-digits",
        &[("data", images.clone()), ("labels", labels.clone())],
    )
    .await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let idx = reply.body;
    ensure!(idx["kind"] == "idx" && idx["samples"] == 20, "{idx}");
    ensure!(idx["sample_shape"] == json!([1, 8, 8]), "{idx}");
    let stored = [images.as_slice(), labels.as_slice()].concat();
    ensure!(idx["digest"] == sha256_hex(&stored), "{idx}");
    ensure!(idx["size_bytes"] == stored.len() as u64, "{idx}");

    // NPY: u8 images of 64 values, i64 labels.
    let pixels: Vec<u8> = (0..12 * 64).map(|i| (i % 251) as u8).collect();
    let npy_labels: Vec<u8> = (0..12i64).flat_map(|i| (i % 3).to_le_bytes()).collect();
    let reply = put_dataset(
        &admin,
        "npy.small",
        &[
            ("data", npy("|u1", "(12, 64)", &pixels)),
            ("labels", npy("<i8", "(12,)", &npy_labels)),
        ],
    )
    .await?;
    ensure!(reply.status == 201, "{}", reply.body);
    ensure!(
        reply.body["kind"] == "npy" && reply.body["sample_shape"] == json!([64]),
        "{}",
        reply.body
    );
    ensure!(reply.body["classes"] == 3, "{}", reply.body);

    let list = admin.ok("/api/v1/datasets").await?;
    let names: Vec<&str> = list["datasets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str())
        .collect();
    ensure!(names == ["digits", "idx-digits", "npy.small"], "{list}");
    let got = admin.ok("/api/v1/datasets/digits").await?;
    ensure!(
        got == digits,
        "GET {got} differs from the upload's answer {digits}"
    );

    // A name is not replaced: it must be deleted first.
    let again = put_dataset(&admin, "digits", &[("data", csv.clone())]).await?;
    ensure_refused(&again, 409, "digits", "exists")?;
    ensure!(message(&again).contains("DELETE"), "{}", again.body);

    let deleted = admin
        .send(reqwest::Method::DELETE, "/api/v1/datasets/npy.small", None)
        .await?;
    ensure!(deleted.status == 204, "{}", deleted.body);
    let gone = admin.get("/api/v1/datasets/npy.small").await?;
    ensure_refused(&gone, 404, "npy.small", "no such dataset")?;
    let twice = admin
        .send(reqwest::Method::DELETE, "/api/v1/datasets/npy.small", None)
        .await?;
    ensure!(twice.status == 404, "{}", twice.body);
    let list = admin.ok("/api/v1/datasets").await?;
    ensure!(
        list["datasets"].as_array().map(Vec::len) == Some(2),
        "{list}"
    );

    // A viewer may read, not write.
    let viewer = viewer_token(&admin).await?;
    let viewer = server.admin_as(&viewer);
    ensure!(viewer.get("/api/v1/datasets").await?.status == 200);
    let refused = put_dataset(&viewer, "mine", &[("data", csv)]).await?;
    ensure!(refused.status == 403, "{}", refused.body);
    Ok(())
}

async fn viewer_token(admin: &Admin) -> Result<String> {
    let reply = admin
        .post(
            "/api/v1/tokens",
            json!({"label": "viewer", "role": "viewer", "expires_in": "1h"}),
        )
        .await?;
    ensure!(reply.status == 201, "{}", reply.body);
    Ok(reply.body["secret"]
        .as_str()
        .unwrap_or_default()
        .to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datasets_upload_list_get_delete_on_sqlite() -> Result<()> {
    upload_list_get_delete(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datasets_upload_list_get_delete_on_postgres() -> Result<()> {
    upload_list_get_delete(Database::Postgres).await
}

async fn malformed_uploads_are_refused(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let mut truncated = idx_images(20);
    truncated.truncate(truncated.len() - 100);
    let reply = put_dataset(
        &admin,
        "cut",
        &[("data", truncated), ("labels", idx_labels(20))],
    )
    .await?;
    ensure_refused(
        &reply,
        422,
        "cut",
        "the `data` part is not a valid idx file",
    )?;

    let reply = put_dataset(
        &admin,
        "miscount",
        &[("data", idx_images(20)), ("labels", idx_labels(19))],
    )
    .await?;
    ensure_refused(
        &reply,
        422,
        "miscount",
        "the `labels` part is not a valid idx file",
    )?;
    ensure!(message(&reply).contains("19"), "{}", reply.body);

    let reply = put_dataset(&admin, "unlabelled", &[("data", gzip(&idx_images(5)))]).await?;
    ensure_refused(&reply, 422, "unlabelled", "needs its labels")?;

    let reply = put_dataset(
        &admin,
        "csv-labels",
        &[
            ("data", b"1,2,0\n3,4,1\n".to_vec()),
            ("labels", idx_labels(2)),
        ],
    )
    .await?;
    ensure_refused(&reply, 422, "csv-labels", "takes no `labels` part")?;

    let reply = put_dataset(&admin, "words", &[("data", b"a,b,label\n1,x,0\n".to_vec())]).await?;
    ensure_refused(
        &reply,
        422,
        "words",
        "the `data` part is not a valid csv file",
    )?;

    let reply = put_dataset(
        &admin,
        "extra",
        &[("data", b"1,2,0\n".to_vec()), ("notes", b"hi".to_vec())],
    )
    .await?;
    ensure_refused(&reply, 400, "extra", "a part named `notes`")?;

    let reply = put_dataset(&admin, "nodata", &[("labels", idx_labels(3))]).await?;
    ensure_refused(&reply, 400, "nodata", "no `data` part")?;

    let reply = admin
        .send(
            reqwest::Method::PUT,
            "/api/v1/datasets/json",
            Some(json!({"data": "1,2,0"})),
        )
        .await?;
    ensure_refused(&reply, 400, "json", "not multipart/form-data")?;

    for bad in ["bad$name", "has%20space", &"n".repeat(65)] {
        let reply = put_dataset(&admin, bad, &[("data", b"1,2,0\n".to_vec())]).await?;
        ensure_name_refused(&reply, bad)?;
    }
    let list = admin.ok("/api/v1/datasets").await?;
    ensure!(
        list["datasets"] == json!([]),
        "a refused upload was stored: {list}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_uploads_are_refused_on_sqlite() -> Result<()> {
    malformed_uploads_are_refused(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_uploads_are_refused_on_postgres() -> Result<()> {
    malformed_uploads_are_refused(Database::Postgres).await
}

/// `limits.max_dataset_bytes` and `limits.max_datasets`, set in the file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn uploads_stop_at_the_size_and_count_limits() -> Result<()> {
    let work = tempfile::tempdir()?;
    let config = work.path().join("canopy.toml");
    std::fs::write(
        &config,
        "[limits]\nmax_dataset_bytes = 4096\nmax_datasets = 2\n",
    )?;
    let config = config.to_string_lossy().into_owned();
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let admin = server.admin();
    let reply = put_dataset(&admin, "digits", &[("data", digits_csv_gz())]).await?;
    ensure_refused(&reply, 413, "digits", "over the 4096-byte limit")?;
    ensure!(
        message(&reply).contains("limits.max_dataset_bytes"),
        "{}",
        reply.body
    );
    // Uploads under the limit pass, up to the count limit.
    let small = b"1,2,0\n3,4,1\n".to_vec();
    for name in ["one", "two"] {
        let reply = put_dataset(&admin, name, &[("data", small.clone())]).await?;
        ensure!(reply.status == 201, "{}", reply.body);
    }
    let reply = put_dataset(&admin, "three", &[("data", small)]).await?;
    ensure_refused(&reply, 409, "three", "holds 2 datasets")?;
    ensure!(
        message(&reply).contains("limits.max_datasets"),
        "{}",
        reply.body
    );
    Ok(())
}

async fn jobs_name_datasets_that_exist_and_fit(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let version = admin.upload_model("logreg", logreg_model_bytes(3)).await?;
    let version_id = version["id"].as_i64().unwrap_or_default();
    let spec = |dataset: &str| {
        json!({
            "name": "central", "model_version_id": version_id, "rounds": 1,
            "min_devices": 1, "target_devices": 1, "round_deadline_ms": 60_000,
            "local_epochs": 1, "batch_size": 8, "learning_rate": 0.1,
            "evaluation": {"central_dataset": dataset},
        })
    };
    let missing = admin.post("/api/v1/jobs", spec("digits")).await?;
    ensure!(missing.status == 422, "{}", missing.body);
    ensure!(
        message(&missing).contains("`digits`") && message(&missing).contains("does not exist"),
        "{}",
        missing.body
    );
    let reply = put_dataset(&admin, "narrow", &[("data", b"1,2,0\n3,4,1\n".to_vec())]).await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let narrow = admin.post("/api/v1/jobs", spec("narrow")).await?;
    ensure!(narrow.status == 422, "{}", narrow.body);
    ensure!(
        message(&narrow).contains("[2]") && message(&narrow).contains("[64]"),
        "{}",
        narrow.body
    );

    // IDX images of [1, 8, 8] fit a model that takes 64 values.
    let reply = put_dataset(
        &admin,
        "images",
        &[("data", idx_images(10)), ("labels", idx_labels(10))],
    )
    .await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let created = admin.post("/api/v1/jobs", spec("images")).await?;
    ensure!(created.status == 201, "{}", created.body);
    ensure!(
        created.body["spec"]["evaluation"]["central_dataset"] == "images",
        "{}",
        created.body
    );
    let job = created.body["id"].as_i64().unwrap_or_default();

    // The job has not finished, so its dataset stays.
    let refused = admin
        .send(reqwest::Method::DELETE, "/api/v1/datasets/images", None)
        .await?;
    ensure_refused(&refused, 409, "images", &format!("job {job}"))?;
    let cancelled = admin
        .post(&format!("/api/v1/jobs/{job}/cancel"), json!({}))
        .await?;
    ensure!(cancelled.status == 200, "{}", cancelled.body);
    let deleted = admin
        .send(reqwest::Method::DELETE, "/api/v1/datasets/images", None)
        .await?;
    ensure!(deleted.status == 204, "{}", deleted.body);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_name_datasets_that_exist_and_fit_on_sqlite() -> Result<()> {
    jobs_name_datasets_that_exist_and_fit(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn jobs_name_datasets_that_exist_and_fit_on_postgres() -> Result<()> {
    jobs_name_datasets_that_exist_and_fit(Database::Postgres).await
}

/// A refused name is answered 422 with the name rule and a hint.
fn ensure_name_refused(reply: &Reply, name: &str) -> Result<()> {
    let text = message(reply);
    ensure!(reply.status == 422, "name {name:?}: {}", reply.body);
    ensure!(
        text.contains("1 to 64 characters of [A-Za-z0-9_.-], starting with a letter or digit")
            && text.contains("hint:"),
        "the refusal of {name:?} should state the name rule and give a hint: {text}"
    );
    Ok(())
}

/// One HTTP/1.1 request over a raw TLS connection, for paths an HTTP
/// library normalizes away (`/api/v1/datasets/..`): status and body.
async fn raw_request(
    server: &TestServer,
    method: &str,
    path: &str,
    body: Option<(&str, Vec<u8>)>,
) -> Result<(u16, String)> {
    let connector = server.tls_connector()?;
    let mut tls = raw::tls_from(&connector, raw::loopback(1, 0), server.socket_addr()).await?;
    let (content_type, bytes) = body.unwrap_or(("application/octet-stream", Vec::new()));
    let head = format!(
        "{method} {path} HTTP/1.1\r\nHost: localhost\r\nAuthorization: Bearer {}\r\n\
         Content-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        server.admin_token,
        bytes.len()
    );
    tls.write_all(head.as_bytes()).await?;
    tls.write_all(&bytes).await?;
    let mut answer = Vec::new();
    // The server may close without close_notify; what arrived is the answer.
    let _ = tls.read_to_end(&mut answer).await;
    let text = String::from_utf8_lossy(&answer).into_owned();
    let status = text
        .split(' ')
        .nth(1)
        .and_then(|code| code.parse().ok())
        .with_context(|| format!("no status line in {text:?}"))?;
    let body = text
        .split("\r\n\r\n")
        .nth(1)
        .unwrap_or_default()
        .to_string();
    Ok((status, body))
}

/// A multipart body with one `data` part, as `(content type, bytes)`.
fn multipart_data(bytes: &[u8]) -> (&'static str, Vec<u8>) {
    let mut body = b"--canopy-boundary\r\nContent-Disposition: form-data; name=\"data\"; \
        filename=\"data\"\r\nContent-Type: application/octet-stream\r\n\r\n"
        .to_vec();
    body.extend(bytes);
    body.extend(b"\r\n--canopy-boundary--\r\n");
    ("multipart/form-data; boundary=canopy-boundary", body)
}

/// Names that are paths, hidden files or options are refused (422, naming
/// the rule); names stored before the rule existed can still be read and
/// removed, `..` included (over a raw request, since HTTP libraries
/// resolve a `..` segment before sending).
async fn names_are_names_not_paths_or_options(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let csv = b"1,2,0\n3,4,1\n".to_vec();
    for bad in [".hidden", "-rf", "_x"] {
        let reply = put_dataset(&admin, bad, &[("data", csv.clone())]).await?;
        ensure_name_refused(&reply, bad)?;
    }
    for segment in ["..", "."] {
        let path = format!("/api/v1/datasets/{segment}");
        let (status, body) = raw_request(&server, "PUT", &path, Some(multipart_data(&csv))).await?;
        ensure!(status == 422, "PUT `{segment}`: {status} {body}");
        ensure!(body.contains("starting with a letter or digit"), "{body}");
    }
    for good in ["a", "9.x", "digits-2_b.v1"] {
        let reply = put_dataset(&admin, good, &[("data", csv.clone())]).await?;
        ensure!(reply.status == 201, "name {good:?}: {}", reply.body);
    }

    // Rows an older server stored under names the rule now refuses.
    sqlx::any::install_default_drivers();
    let any = sqlx::AnyPool::connect(&server.database_url).await?;
    for legacy in ["..", ".hidden", "-rf"] {
        sqlx::query(
            "INSERT INTO datasets (name, kind, samples, sample_shape, classes, size_bytes, \
             data_bytes, digest, blob_key, created_unix_ms) \
             VALUES ($1, 'csv', 2, '[2]', 2, 12, 12, $2, $2, 1)",
        )
        .bind(legacy)
        .bind(sha256_hex(&csv))
        .execute(&any)
        .await?;
    }
    for legacy in [".hidden", "-rf"] {
        let got = admin.get(&format!("/api/v1/datasets/{legacy}")).await?;
        ensure!(got.status == 200, "GET {legacy}: {}", got.body);
        let deleted = admin
            .send(
                reqwest::Method::DELETE,
                &format!("/api/v1/datasets/{legacy}"),
                None,
            )
            .await?;
        ensure!(deleted.status == 204, "DELETE {legacy}: {}", deleted.body);
    }
    let (status, body) = raw_request(&server, "DELETE", "/api/v1/datasets/..", None).await?;
    ensure!(status == 204, "DELETE `..`: {status} {body}");
    let list = admin.ok("/api/v1/datasets").await?;
    let names: Vec<&str> = list["datasets"]
        .as_array()
        .into_iter()
        .flatten()
        .filter_map(|d| d["name"].as_str())
        .collect();
    ensure!(names == ["9.x", "a", "digits-2_b.v1"], "{list}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_names_not_paths_or_options_on_sqlite() -> Result<()> {
    names_are_names_not_paths_or_options(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_names_not_paths_or_options_on_postgres() -> Result<()> {
    names_are_names_not_paths_or_options(Database::Postgres).await
}

/// NaN and ±inf are refused in every format, naming the part and where
/// the value is (an NPY of f8 values past f32's range too: they would
/// become infinite); CSV already refused them.
async fn non_finite_values_are_refused(database: Database) -> Result<()> {
    let server = TestServer::start(database)?;
    let admin = server.admin();
    let labels: Vec<u8> = (0..3i64).flat_map(|i| i.to_le_bytes()).collect();
    let labels = npy("<i8", "(3,)", &labels);
    for (name, bad, at) in [
        ("nan", f32::NAN, 3usize),
        ("inf", f32::INFINITY, 5),
        ("neg-inf", f32::NEG_INFINITY, 0),
    ] {
        let mut values = [0.5f32; 6];
        values[at] = bad;
        let data: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        for gzipped in [false, true] {
            let data = npy("<f4", "(3, 2)", &data);
            let data = if gzipped { gzip(&data) } else { data };
            let reply =
                put_dataset(&admin, name, &[("data", data), ("labels", labels.clone())]).await?;
            ensure_refused(&reply, 422, name, "the `data` part is not a valid npy file")?;
            let (sample, value) = (at / 2, at % 2);
            ensure!(
                message(&reply).contains(&format!("value {value} of sample {sample}"))
                    && message(&reply).contains("not a finite number"),
                "the refusal should say where the value is: {}",
                reply.body
            );
        }
    }
    let huge: Vec<u8> = [1e300f64, 0.0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let one_label = npy("<i8", "(1,)", &0i64.to_le_bytes());
    let reply = put_dataset(
        &admin,
        "huge",
        &[("data", npy("<f8", "(1, 2)", &huge)), ("labels", one_label)],
    )
    .await?;
    ensure_refused(&reply, 422, "huge", "not a finite number")?;
    let reply = put_dataset(&admin, "csv-nan", &[("data", b"1,2,0\n1,nan,1\n".to_vec())]).await?;
    ensure_refused(
        &reply,
        422,
        "csv-nan",
        "line 2, column 2: not a finite number",
    )?;
    let list = admin.ok("/api/v1/datasets").await?;
    ensure!(
        list["datasets"] == json!([]),
        "a refused upload was stored: {list}"
    );
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_values_are_refused_on_sqlite() -> Result<()> {
    non_finite_values_are_refused(Database::Sqlite).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn non_finite_values_are_refused_on_postgres() -> Result<()> {
    non_finite_values_are_refused(Database::Postgres).await
}

const MIB: u64 = 1 << 20;

/// `head`, then `mib` MiB of `filler`, gzipped: each MiB is one gzip
/// member (compressed once and repeated), so a bomb of hundreds of MiB
/// is a few hundred KB and costs the test nothing to build.
fn gzip_bomb(head: &[u8], filler: u8, mib: usize) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder
        .write_all(&vec![filler; MIB as usize])
        .expect("gzip");
    let block = encoder.finish().expect("gzip");
    let mut bomb = gzip(head);
    for _ in 0..mib {
        bomb.extend_from_slice(&block);
    }
    bomb
}

/// The peak resident memory one dataset upload may add, as docs/limits.md
/// sizes it: the parsed values (4 bytes each) and labels (8 bytes per
/// sample, at most one per value), or the stored bytes read back for the
/// blob, whichever is more; plus 16 MiB for buffers and allocator slack.
fn upload_sizing_bytes(max_dataset_bytes: u64, max_dataset_values: u64) -> u64 {
    (12 * max_dataset_values).max(max_dataset_bytes) + 16 * MIB
}

/// Gzip bombs: an IDX file whose header declares 2^30 values and a CSV
/// file of 512 MiB of blank lines, each about 520 KB on the wire. Both are
/// refused (413, naming the setting) before they decompress past the
/// limit, and the server's peak resident memory stays within the sizing
/// the limits give.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn gzip_bombs_are_refused_before_they_decompress() -> Result<()> {
    let (max_bytes, max_values) = (8 * MIB, 2 * MIB);
    let work = tempfile::tempdir()?;
    let config = support::limits_file(
        work.path(),
        &format!("max_dataset_bytes = {max_bytes}\nmax_dataset_values = {max_values}"),
    )?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let admin = server.admin();
    // Warm up: one small upload, so the peak below is the bomb's.
    let reply = put_dataset(&admin, "warm", &[("data", b"1,2,0\n3,4,1\n".to_vec())]).await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let before_kib = server.memory_kib("VmHWM")?;

    // 2^24 images of 8×8: the header alone says it is too many values.
    let mut header = vec![0, 0, 8, 3];
    for dim in [1u32 << 24, 8, 8] {
        header.extend(dim.to_be_bytes());
    }
    let idx_bomb = gzip_bomb(&header, 0, 512);
    let reply = put_dataset(
        &admin,
        "idx-bomb",
        &[("data", idx_bomb.clone()), ("labels", idx_labels(4))],
    )
    .await?;
    ensure_refused(&reply, 413, "idx-bomb", "the `data` part")?;
    ensure!(
        message(&reply).contains("limits.max_dataset_values")
            && message(&reply).contains(&max_values.to_string()),
        "{}",
        reply.body
    );

    // Blank lines hold no values: only the decompressed bytes bound them.
    let csv_bomb = gzip_bomb(b"1,2,0\n", b'\n', 512);
    let reply = put_dataset(&admin, "csv-bomb", &[("data", csv_bomb.clone())]).await?;
    ensure_refused(&reply, 413, "csv-bomb", "the `data` part")?;
    ensure!(
        message(&reply).contains("limits.max_dataset_bytes")
            && message(&reply).contains(&max_bytes.to_string()),
        "{}",
        reply.body
    );

    let peak_kib = server.memory_kib("VmHWM")?;
    let grown = (peak_kib.saturating_sub(before_kib)) * 1024;
    let bound = upload_sizing_bytes(max_bytes, max_values);
    println!(
        "gzip bombs of {} and {} bytes (512 MiB each decompressed): peak RSS {before_kib} KiB \
         before, {peak_kib} KiB after, +{} MiB; bound +{} MiB",
        idx_bomb.len(),
        csv_bomb.len(),
        grown / MIB,
        bound / MIB
    );
    ensure!(
        grown <= bound,
        "the bombs raised the server's peak RSS by {grown} bytes, over the {bound} the limits allow"
    );
    let list = admin.ok("/api/v1/datasets").await?;
    ensure!(
        list["datasets"].as_array().map(Vec::len) == Some(1),
        "{list}"
    );
    Ok(())
}

/// A legitimately large dataset (40,000 images of 28×28: 31 million
/// values, 125 MB parsed) costs what the sizing says while it is
/// uploaded, and its memory is returned: after it is deleted the server's
/// resident memory is back near where it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_dataset_is_returned_to_the_system_after_deletion() -> Result<()> {
    let (max_bytes, max_values) = (64 * MIB, 32 * MIB);
    let work = tempfile::tempdir()?;
    let config = support::limits_file(
        work.path(),
        &format!("max_dataset_bytes = {max_bytes}\nmax_dataset_values = {max_values}"),
    )?;
    let server = TestServer::start_with(Database::Sqlite, &["--config", &config])?;
    let admin = server.admin();
    // Warm up the paths an upload takes (threads, pools, arenas).
    let (small_images, small_labels) = (gzip(&idx_images(64)), idx_labels(64));
    for _ in 0..2 {
        let reply = put_dataset(
            &admin,
            "warm",
            &[
                ("data", small_images.clone()),
                ("labels", small_labels.clone()),
            ],
        )
        .await?;
        ensure!(reply.status == 201, "{}", reply.body);
        let deleted = admin
            .send(reqwest::Method::DELETE, "/api/v1/datasets/warm", None)
            .await?;
        ensure!(deleted.status == 204, "{}", deleted.body);
    }
    let (rss_before, hwm_before) = (server.memory_kib("VmRSS")?, server.memory_kib("VmHWM")?);

    let n: u32 = 40_000;
    let mut images = vec![0, 0, 8, 3];
    for dim in [n, 28, 28] {
        images.extend(dim.to_be_bytes());
    }
    images.extend((0..n as usize * 784).map(|i| (i * 31 % 251) as u8));
    let labels = idx_labels(n);
    let reply = put_dataset(&admin, "large", &[("data", images), ("labels", labels)]).await?;
    ensure!(reply.status == 201, "{}", reply.body);
    let (rss_stored, hwm) = (server.memory_kib("VmRSS")?, server.memory_kib("VmHWM")?);
    let deleted = admin
        .send(reqwest::Method::DELETE, "/api/v1/datasets/large", None)
        .await?;
    ensure!(deleted.status == 204, "{}", deleted.body);
    let rss_after = server.memory_kib("VmRSS")?;
    println!(
        "a 31 MB IDX dataset (31,360,000 values): RSS {rss_before} KiB before, {rss_stored} KiB \
         once stored, {rss_after} KiB after deletion; peak {hwm_before} KiB before, {hwm} KiB \
         during the upload"
    );
    let bound = upload_sizing_bytes(max_bytes, max_values);
    let grown = hwm.saturating_sub(hwm_before) * 1024;
    ensure!(
        grown <= bound,
        "the upload raised the peak RSS by {grown} bytes, over the {bound} the limits allow"
    );
    let tolerance_kib = 32 * 1024;
    ensure!(
        rss_after <= rss_before + tolerance_kib,
        "after deletion the server holds {} KiB more than before the upload (tolerance {tolerance_kib} KiB)",
        rss_after.saturating_sub(rss_before)
    );
    Ok(())
}
