//! `canopy dataset push|ls|rm`: datasets kept on the server (for central
//! evaluation), sent as `multipart/form-data` to `PUT /api/v1/datasets/{name}`
//! with a `data` part and, for IDX and NPY images, a `labels` part. The
//! server detects the format from the bytes.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use clap::Args;
use reqwest::Method;
use reqwest::multipart::{Form, Part};

use crate::commands::models::print_or_empty;
use crate::output::outln;
use crate::remote::table::Table;
use crate::remote::{self, Payload, Remote, Subject, ago, cell, print_json, short};

/// Largest file sent as one part. Files are streamed from disk, so this
/// bounds the upload's time, not memory; the server has its own limit.
pub const MAX_DATASET_FILE_BYTES: u64 = 1 << 30;

#[derive(Args)]
pub struct PushArgs {
    /// The dataset's name on the server.
    name: String,
    /// CSV or CSV.gz (label in the last column), or an IDX or NPY images file.
    file: PathBuf,
    /// The labels file, for IDX and NPY images.
    #[arg(long)]
    labels: Option<PathBuf>,
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ListArgs {
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RemoveArgs {
    /// The dataset's name on the server.
    name: String,
}

fn subject(name: &str) -> Subject {
    Subject::new(format!("dataset `{name}`"), Some("canopy dataset ls"))
}

pub fn push(args: PushArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let dataset = remote::block_on(async {
        let form = upload_form(&args.file, args.labels.as_deref()).await?;
        remote
            .call(
                Method::PUT,
                &dataset_path(&args.name),
                Payload::Form(form),
                &subject(&args.name),
            )
            .await
    })?;
    if args.json {
        return print_json(&dataset);
    }
    outln!(
        "pushed dataset `{}`: {} {} samples of shape {}, {} classes, {} bytes, digest {}",
        cell(&dataset["name"], 0),
        cell(&dataset["samples"], 0),
        cell(&dataset["kind"], 0),
        cell(&dataset["sample_shape"], 0),
        cell(&dataset["classes"], 0),
        cell(&dataset["size_bytes"], 0),
        short(dataset["digest"].as_str().unwrap_or("-"), 16),
    )?;
    Ok(())
}

pub fn list(args: ListArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    let answer = remote::block_on(async {
        remote
            .get("/api/v1/datasets", &Subject::new("datasets", None))
            .await
    })?;
    let datasets = answer["datasets"].as_array().cloned().unwrap_or_default();
    if args.json {
        return print_json(&datasets);
    }
    let mut table = Table::new(&[
        "NAME", "KIND", "SAMPLES", "SHAPE", "CLASSES", "BYTES", "DIGEST", "CREATED",
    ]);
    for dataset in &datasets {
        table.row(vec![
            cell(&dataset["name"], 0),
            cell(&dataset["kind"], 0),
            cell(&dataset["samples"], 0),
            cell(&dataset["sample_shape"], 0),
            cell(&dataset["classes"], 0),
            cell(&dataset["size_bytes"], 0),
            short(dataset["digest"].as_str().unwrap_or("-"), 16).to_string(),
            ago(dataset["created_unix_ms"].as_i64()),
        ]);
    }
    print_or_empty(
        &table,
        "no datasets on the server; push one with `canopy dataset push NAME FILE`",
    )
}

pub fn remove(args: RemoveArgs) -> Result<()> {
    let remote = Remote::from_saved()?;
    remote::block_on(async {
        remote
            .call(
                Method::DELETE,
                &dataset_path(&args.name),
                Payload::Empty,
                &subject(&args.name),
            )
            .await
    })?;
    outln!("removed dataset `{}`", args.name)?;
    Ok(())
}

fn dataset_path(name: &str) -> String {
    format!("/api/v1/datasets/{name}")
}

/// The multipart body: `data`, and `labels` when given.
pub async fn upload_form(data: &Path, labels: Option<&Path>) -> Result<Form> {
    let mut form = Form::new().part("data", file_part(data).await?);
    if let Some(labels) = labels {
        form = form.part("labels", file_part(labels).await?);
    }
    Ok(form)
}

/// A file as a part streamed from disk, named by its file name.
async fn file_part(path: &Path) -> Result<Part> {
    let context = || format!("cannot read dataset file `{}`", path.display());
    let file = tokio::fs::File::open(path).await.with_context(context)?;
    let metadata = file.metadata().await.with_context(context)?;
    if !metadata.is_file() {
        bail!("dataset file `{}` is not a regular file", path.display());
    }
    if metadata.len() > MAX_DATASET_FILE_BYTES {
        bail!(
            "dataset file `{}` is {} bytes, over the limit of {MAX_DATASET_FILE_BYTES}",
            path.display(),
            metadata.len()
        );
    }
    let name = path
        .file_name()
        .map(|name| name.to_string_lossy().into_owned())
        .unwrap_or_else(|| "data".into());
    Ok(
        Part::stream_with_length(reqwest::Body::from(file), metadata.len())
            .file_name(name)
            .mime_str("application/octet-stream")?,
    )
}

#[cfg(test)]
mod tests {
    use std::io::{BufRead, BufReader, Read, Write};
    use std::net::TcpListener;

    use super::*;
    use crate::remote::Login;

    /// Answers one request on a loopback socket with `status` and `body`,
    /// and hands back the request as it arrived (head, body).
    fn answer_once(
        status: &str,
        body: &str,
    ) -> (String, std::thread::JoinHandle<(String, Vec<u8>)>) {
        let listener = TcpListener::bind("127.0.0.1:0").unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        let response = format!(
            "HTTP/1.1 {status}\r\ncontent-type: application/json\r\ncontent-length: {}\r\nconnection: close\r\n\r\n{body}",
            body.len()
        );
        let handle = std::thread::spawn(move || {
            let (stream, _) = listener.accept().unwrap();
            let mut reader = BufReader::new(stream);
            let mut head = String::new();
            loop {
                let mut line = String::new();
                reader.read_line(&mut line).unwrap();
                head.push_str(&line);
                if line == "\r\n" || line.is_empty() {
                    break;
                }
            }
            // Uploads of files of known size announce their length; a
            // request without one (DELETE) has no body.
            let length: usize = head
                .lines()
                .find_map(|line| {
                    let (name, value) = line.split_once(':')?;
                    name.eq_ignore_ascii_case("content-length")
                        .then(|| value.trim().parse().ok())?
                })
                .unwrap_or(0);
            let mut body = vec![0; length];
            reader.read_exact(&mut body).unwrap();
            reader.get_mut().write_all(response.as_bytes()).unwrap();
            (head, body)
        });
        (url, handle)
    }

    fn remote(url: String) -> Remote {
        Remote::new(Login {
            url,
            token: "cnpa_test".into(),
            fingerprint: None,
            ca_cert: None,
        })
        .unwrap()
    }

    #[test]
    fn a_push_sends_data_and_labels_as_named_multipart_parts() {
        let dir = tempfile::tempdir().unwrap();
        let images = dir.path().join("train-images.npy");
        let labels = dir.path().join("train-labels.npy");
        std::fs::write(&images, b"\x93NUMPY images").unwrap();
        std::fs::write(&labels, b"\x93NUMPY labels").unwrap();
        let view = r#"{"name":"mnist","kind":"npy","samples":2,"sample_shape":[28,28],"classes":10,"size_bytes":26,"digest":"ab","created_unix_ms":1}"#;
        let (url, server) = answer_once("201 Created", view);
        let remote = remote(url);
        let answer = remote::block_on(async {
            let form = upload_form(&images, Some(&labels)).await?;
            remote
                .call(
                    Method::PUT,
                    &dataset_path("mnist"),
                    Payload::Form(form),
                    &subject("mnist"),
                )
                .await
        })
        .unwrap();
        assert_eq!(answer["kind"], "npy");
        let (head, body) = server.join().unwrap();
        assert!(
            head.starts_with("PUT /api/v1/datasets/mnist HTTP/1.1\r\n"),
            "{head}"
        );
        assert!(
            head.to_ascii_lowercase()
                .contains("authorization: bearer cnpa_test\r\n"),
            "{head}"
        );
        let boundary = head
            .lines()
            .find_map(|line| {
                line.to_ascii_lowercase()
                    .strip_prefix("content-type: multipart/form-data; boundary=")
                    .map(str::to_string)
            })
            .expect("a multipart content type with a boundary");
        let body = String::from_utf8_lossy(&body);
        let parts: Vec<&str> = body.split(&format!("--{boundary}")).collect();
        // Preamble, two parts, and the closing `--`.
        assert_eq!(parts.len(), 4, "{body}");
        assert!(
            parts[1].contains("name=\"data\"; filename=\"train-images.npy\""),
            "{}",
            parts[1]
        );
        assert!(
            parts[1].ends_with("\r\n\r\n\u{fffd}NUMPY images\r\n"),
            "{:?}",
            parts[1]
        );
        assert!(
            parts[2].contains("name=\"labels\"; filename=\"train-labels.npy\""),
            "{}",
            parts[2]
        );
        assert!(
            parts[2].ends_with("\u{fffd}NUMPY labels\r\n"),
            "{:?}",
            parts[2]
        );
        assert_eq!(parts[3].trim(), "--");
    }

    #[test]
    fn a_refusal_names_the_dataset_the_cause_and_where_to_look() {
        let (url, server) = answer_once(
            "404 Not Found",
            r#"{"error":{"code":"not_found","message":"dataset `nope` does not exist"}}"#,
        );
        let remote = remote(url);
        let error = remote::block_on(async {
            remote
                .call(
                    Method::DELETE,
                    &dataset_path("nope"),
                    Payload::Empty,
                    &subject("nope"),
                )
                .await
        })
        .unwrap_err();
        server.join().unwrap();
        let text = format!("{error:#}");
        assert!(
            text.starts_with("dataset `nope` does not exist on http://127.0.0.1:"),
            "{text}"
        );
        assert!(
            text.contains("404 not_found: dataset `nope` does not exist"),
            "{text}"
        );
        assert!(text.contains("canopy dataset ls"), "{text}");
    }

    #[test]
    fn files_that_are_missing_or_not_files_are_refused_before_sending() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("missing.csv");
        let error = remote::block_on(upload_form(&missing, None)).unwrap_err();
        assert!(format!("{error:#}").contains("missing.csv"), "{error:#}");
        let error = remote::block_on(upload_form(dir.path(), None)).unwrap_err();
        assert!(
            format!("{error:#}").contains("not a regular file"),
            "{error:#}"
        );
    }
}
