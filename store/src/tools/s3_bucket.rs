//! Test tool: create a bucket on the loopback S3 server that scripts/s3_server.sh starts. The
//! request is signed (a presigned URL), so it works on servers that check credentials
//! (SeaweedFS) as well as on those that take anything (moto).
use std::io::{Error, ErrorKind, Read, Result, Write};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::signer::Signer;

/// Creates `bucket` on the plain-HTTP S3 server at `endpoint`, signed with the credentials in
/// `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`; a bucket that already exists is not an error.
pub fn create_bucket(endpoint: &str, bucket: &str) -> Result<()> {
    let var = |name: &str| {
        std::env::var(name).map_err(|_| {
            Error::new(
                ErrorKind::InvalidInput,
                format!("{name} is not set (scripts/s3_server.sh exports the test server's keys)"),
            )
        })
    };
    let store = AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_allow_http(true)
        .with_bucket_name(bucket)
        .with_region(var("AWS_REGION").unwrap_or_else(|_| "us-east-1".into()))
        .with_access_key_id(var("AWS_ACCESS_KEY_ID")?)
        .with_secret_access_key(var("AWS_SECRET_ACCESS_KEY")?)
        .build()
        .map_err(|e| Error::new(ErrorKind::InvalidInput, format!("{endpoint}: {e}")))?;
    // Static keys sign without any I/O, so blocking here is safe even on a runtime thread.
    // The empty path makes the bucket's own URL (`/<bucket>/`), where a PUT creates it.
    let url = futures::executor::block_on(store.signed_url(
        http::Method::PUT,
        &Path::from(""),
        Duration::from_secs(300),
    ))
    .map_err(|e| Error::other(format!("{endpoint}: signing the bucket creation: {e}")))?;
    let host = match (url.host_str(), url.port()) {
        (Some(h), Some(p)) => format!("{h}:{p}"),
        (Some(h), None) => h.to_string(),
        _ => {
            return Err(Error::new(
                ErrorKind::InvalidInput,
                format!("{endpoint}: no host in the endpoint"),
            ))
        }
    };
    let target = match url.query() {
        Some(q) => format!("{}?{q}", url.path()),
        None => url.path().to_string(),
    };
    let mut conn = std::net::TcpStream::connect(&host)?;
    // The Host header is part of what was signed, port included.
    write!(
        conn,
        "PUT {target} HTTP/1.1\r\nHost: {host}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )?;
    let mut response = String::new();
    conn.read_to_string(&mut response)?;
    // BucketAlreadyOwnedByYou or, from moto, BucketAlreadyExists: it is there, as wanted.
    if response.starts_with("HTTP/1.1 200") || response.contains("BucketAlready") {
        Ok(())
    } else {
        Err(Error::other(format!(
            "{endpoint}: creating bucket {bucket} refused: {}",
            response.trim()
        )))
    }
}
