//! Held-out datasets through a real server, on SQLite and PostgreSQL:
//! uploads in each format (CSV, IDX, NPY; gzipped or not) are told apart
//! by their bytes and parsed by the engine's loaders; names, sizes,
//! counts and malformed bodies are refused with errors that name the
//! dataset, the cause and a hint; a dataset a job evaluates on cannot be
//! deleted until the job has finished; jobs name only datasets that exist
//! and fit their model.

mod support;

use std::io::Write as _;
use std::path::Path;

use anyhow::{Result, ensure};
use serde_json::{Value, json};
use sha2::{Digest, Sha256};
use support::{Admin, Database, Reply, TestServer, logreg_model_bytes};

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
        ensure!(reply.status == 400, "name {bad:?}: {}", reply.body);
        ensure!(message(&reply).contains("hint:"), "{}", reply.body);
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
