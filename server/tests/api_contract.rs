//! The admin API keeps the contract it publishes: the OpenAPI document
//! states what the server accepts, and the bearer scheme is read as
//! RFC 9110 says.

use anyhow::{Context, Result, bail};
use serde_json::{Map, Value};

use crate::support::{Database, TestServer, logreg_model_bytes};

/// Follows `$ref`s into `components.schemas`.
fn resolve<'a>(document: &'a Value, schema: &'a Value) -> &'a Value {
    match schema["$ref"].as_str() {
        Some(reference) => {
            let name = reference.trim_start_matches("#/components/schemas/");
            resolve(document, &document["components"]["schemas"][name])
        }
        None => schema,
    }
}

/// True when the schema lets `null` through: `type: [.., "null"]`, or a
/// `oneOf`/`anyOf` branch of type null.
fn allows_null(schema: &Value) -> bool {
    let typed_null = |schema: &Value| match &schema["type"] {
        Value::String(kind) => kind == "null",
        Value::Array(kinds) => kinds.iter().any(|kind| kind == "null"),
        _ => false,
    };
    typed_null(schema)
        || ["oneOf", "anyOf"].iter().any(|key| {
            schema[key]
                .as_array()
                .is_some_and(|branches| branches.iter().any(typed_null))
        })
}

/// Every property path (from the body's root) whose schema allows `null`,
/// descending into nested objects.
fn nullable_paths(document: &Value, schema: &Value, prefix: &[String], out: &mut Vec<Vec<String>>) {
    let schema = resolve(document, schema);
    let Some(properties) = schema["properties"].as_object() else {
        return;
    };
    for (name, property) in properties {
        let mut path = prefix.to_vec();
        path.push(name.clone());
        if allows_null(property) {
            out.push(path.clone());
        }
        nullable_paths(document, property, &path, out);
    }
}

/// Sets `path` in `body` to null, creating the objects on the way.
fn set_null(body: &mut Value, path: &[String]) {
    let mut node = body;
    for name in &path[..path.len() - 1] {
        let object = node.as_object_mut().expect("bodies are objects");
        node = object
            .entry(name.clone())
            .or_insert_with(|| Value::Object(Map::new()));
        if node.is_null() {
            *node = Value::Object(Map::new());
        }
    }
    node.as_object_mut()
        .expect("bodies are objects")
        .insert(path[path.len() - 1].clone(), Value::Null);
}

fn property<'a>(document: &'a Value, schema: &str, name: &str) -> &'a Value {
    resolve(
        document,
        &document["components"]["schemas"][schema]["properties"][name],
    )
}

/// A `null` the document allows in a request body must be accepted: for
/// every JSON request body with an example, each nullable property is set
/// to null in the example and sent; the server may not refuse it as
/// malformed (400) or invalid (422).
#[tokio::test]
async fn every_null_the_document_allows_is_accepted() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    // Version 1, which the jobs example names, so that a job is created.
    admin
        .upload_model("contract", logreg_model_bytes(1))
        .await?;
    let document = admin.ok("/api/v1/openapi.json").await?;
    let mut tried = 0;
    for (route, item) in document["paths"].as_object().context("no paths")? {
        for (method, operation) in item.as_object().context("bad path item")? {
            let content = &operation["requestBody"]["content"]["application/json"];
            let Some(example) = content.get("example") else {
                continue;
            };
            let mut paths = Vec::new();
            nullable_paths(&document, &content["schema"], &[], &mut paths);
            for path in paths {
                let mut body = example.clone();
                set_null(&mut body, &path);
                // Routes with an `{id}` act on the first object (device 1
                // may not exist: a 404 still means the body was accepted).
                let url = route.replace("{id}", "1");
                let method = reqwest::Method::from_bytes(method.to_uppercase().as_bytes())?;
                let reply = admin.send(method.clone(), &url, Some(body.clone())).await?;
                if reply.status == 400 || reply.status == 422 {
                    bail!(
                        "{method} {route}: the document allows null at `{}`, but the server answered {} to {body}: {}",
                        path.join("."),
                        reply.status,
                        reply.body
                    );
                }
                tried += 1;
            }
        }
    }
    // `filters.tier` and the API token's `expires_in` are optional by design.
    assert!(tried >= 2, "only {tried} nullable properties were tried");
    Ok(())
}

/// Lifetimes the server accepts and refuses; the document's pattern must
/// agree on each.
const ACCEPTED: [&str; 10] = [
    "30d", "12h", "90m", "1h 30m", "1h30m", "1.5h", "2 days", " 7d ", "3 weeks", "500ms",
];
const REFUSED: [&str; 9] = [
    "",
    " ",
    "d",
    "-1d",
    "1d;",
    "thirty days",
    "1x",
    "5 dayz",
    "1h x",
];

/// The fields the server refuses `null` or `""` for are stated so: the
/// secure aggregation settings are not nullable and carry their ranges,
/// and a lifetime is a pattern that excludes the empty string.
#[tokio::test]
async fn openapi_states_secure_aggregation_and_lifetimes_exactly() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let document = server.admin().ok("/api/v1/openapi.json").await?;

    let spec = &document["components"]["schemas"]["JobSpec"]["properties"]["secure_aggregation"];
    let secure = resolve(&document, spec);
    let fields = secure["properties"]
        .as_object()
        .context("secure_aggregation has no properties")?;
    assert_eq!(fields.len(), 6, "secure_aggregation fields: {secure}");
    for (name, field) in fields {
        assert!(
            !allows_null(field),
            "secure_aggregation.{name} allows null: {field}"
        );
        if name != "enabled" {
            assert!(
                field.get("minimum").is_some() || field.get("exclusiveMinimum").is_some(),
                "secure_aggregation.{name} states no lower bound: {field}"
            );
            assert!(
                field.get("maximum").is_some(),
                "secure_aggregation.{name} states no upper bound: {field}"
            );
        }
    }

    let accepted = ACCEPTED;
    let refused = REFUSED;
    for (schema, field) in [
        ("CreateApiToken", "expires_in"),
        ("CreateEnrollmentToken", "expires_in"),
    ] {
        let lifetime = property(&document, schema, field);
        let lifetime = lifetime["oneOf"]
            .as_array()
            .and_then(|branches| branches.iter().find(|branch| branch.get("$ref").is_some()))
            .map(|branch| resolve(&document, branch))
            .unwrap_or(lifetime);
        let min_length = lifetime["minLength"].as_u64().unwrap_or(0);
        assert!(min_length >= 1, "{schema}.{field} allows \"\": {lifetime}");
        let pattern = lifetime["pattern"]
            .as_str()
            .with_context(|| format!("{schema}.{field} has no pattern: {lifetime}"))?;
        let pattern = regex::Regex::new(pattern)?;
        for text in accepted {
            assert!(
                pattern.is_match(text),
                "{schema}.{field}'s pattern refuses {text:?}"
            );
        }
        for text in refused {
            assert!(
                !pattern.is_match(text),
                "{schema}.{field}'s pattern allows {text:?}"
            );
        }
    }
    Ok(())
}

/// The lifetimes the pattern test calls accepted are accepted by the
/// server, and the refused ones refused, so the two cannot drift apart.
#[tokio::test]
async fn lifetimes_the_document_shows_match_the_server() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let admin = server.admin();
    for text in ACCEPTED {
        let reply = admin
            .post(
                "/api/v1/enrollment-tokens",
                serde_json::json!({"expires_in": text, "max_uses": 1}),
            )
            .await?;
        assert_eq!(reply.status, 201, "lifetime {text:?}: {}", reply.body);
    }
    for text in REFUSED {
        let reply = admin
            .post(
                "/api/v1/enrollment-tokens",
                serde_json::json!({"expires_in": text, "max_uses": 1}),
            )
            .await?;
        assert_eq!(reply.status, 422, "lifetime {text:?}: {}", reply.body);
    }
    Ok(())
}

/// RFC 9110 §11.1: the scheme is case-insensitive, and one or more spaces
/// separate it from the token.
#[tokio::test]
async fn bearer_scheme_is_case_insensitive() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let http = server.transport().http().clone();
    let url = format!("{}/api/v1/jobs", server.base);
    let token = &server.admin_token;
    for header in [
        format!("Bearer {token}"),
        format!("bearer {token}"),
        format!("BEARER {token}"),
        format!("bEaReR {token}"),
        format!("Bearer   {token}"),
        format!("bearer\t{token}"),
    ] {
        let response = http
            .get(&url)
            .header("authorization", &header)
            .send()
            .await?;
        assert_eq!(
            response.status().as_u16(),
            200,
            "`Authorization: {header}` was refused"
        );
    }
    for header in [
        format!("Basic {token}"),
        format!("Bearer{token}"),
        format!("Bearers {token}"),
        "Bearer".to_string(),
        "Bearer   ".to_string(),
        token.clone(),
    ] {
        let response = http
            .get(&url)
            .header("authorization", &header)
            .send()
            .await?;
        assert_eq!(
            response.status().as_u16(),
            401,
            "`Authorization: {header}` was accepted"
        );
        let body: Value = response.json().await?;
        let message = body["error"]["message"].as_str().unwrap_or_default();
        assert!(
            message.contains("Bearer"),
            "the 401 does not say what to send: {body}"
        );
    }
    Ok(())
}

/// Every `$ref` in `node`, with the JSON pointer of the place it sits.
fn references<'a>(node: &'a Value, at: String, out: &mut Vec<(String, &'a str)>) {
    match node {
        Value::Object(map) => {
            for (key, value) in map {
                match (key.as_str(), value) {
                    ("$ref", Value::String(reference)) => out.push((at.clone(), reference)),
                    _ => references(value, format!("{at}/{}", escape_pointer(key)), out),
                }
            }
        }
        Value::Array(items) => {
            for (index, item) in items.iter().enumerate() {
                references(item, format!("{at}/{index}"), out);
            }
        }
        _ => {}
    }
}

/// A key as a JSON pointer token (RFC 6901).
fn escape_pointer(key: &str) -> String {
    key.replace('~', "~0").replace('/', "~1")
}

/// A local reference's target, if the document has one there (the part
/// after `#` is a JSON pointer).
fn target<'a>(document: &'a Value, reference: &str) -> Option<&'a Value> {
    document.pointer(reference.strip_prefix('#')?)
}

/// Every `$ref` of the document the server serves resolves within it: a
/// dangling one makes Schemathesis skip the operation (the rounds list's
/// `order` parameter pointed at a schema the document lacked).
#[tokio::test]
async fn every_reference_in_the_served_document_resolves() -> Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let document = server.admin().ok("/api/v1/openapi.json").await?;
    let mut found = Vec::new();
    references(&document, String::new(), &mut found);
    let operations = document["paths"]
        .as_object()
        .context("the document has paths")?;
    let order = &document["paths"]["/api/v1/jobs/{id}/rounds"]["get"]["parameters"];
    let order = order
        .as_array()
        .and_then(|all| all.iter().find(|p| p["name"] == "order"))
        .context("the rounds list takes `order`")?;
    if order["schema"].is_null() {
        bail!("the rounds list's `order` has no schema: {order}");
    }
    let dangling: Vec<String> = found
        .iter()
        .filter(|(_, reference)| target(&document, reference).is_none())
        .map(|(at, reference)| format!("{at}: {reference}"))
        .collect();
    if !dangling.is_empty() {
        bail!(
            "{} of {} references resolve to nothing:\n{}",
            dangling.len(),
            found.len(),
            dangling.join("\n")
        );
    }
    if found.len() < operations.len() {
        bail!(
            "only {} references in a document of {} paths: the walk missed them",
            found.len(),
            operations.len()
        );
    }
    eprintln!("{} references, all resolve", found.len());
    Ok(())
}
