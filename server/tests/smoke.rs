use crate::support::{Database, TestServer};

#[tokio::test]
async fn server_starts_and_guards_the_admin_api() -> anyhow::Result<()> {
    let server = TestServer::start(Database::Sqlite)?;
    let anonymous = server.admin_as("");
    assert_eq!(anonymous.get("/api/v1/jobs").await?.status, 401);
    let jobs = server.admin().ok("/api/v1/jobs").await?;
    assert_eq!(jobs["items"].as_array().map(Vec::len), Some(0));
    Ok(())
}
