//! Test tool: create a bucket on the loopback S3 server that scripts/s3_server.sh starts. The
//! request is signed (a presigned URL), so it works on servers that check credentials
//! (SeaweedFS) as well as on those that take anything (moto). Every call makes a bucket of its
//! own: SeaweedFS answered `404 NoSuchBucket` to some of 13 tests that created one shared name
//! at the same time, so tests that run at once never share a bucket.
use std::io::{Error, ErrorKind, Read, Result, Write};
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::path::Path;
use object_store::signer::Signer;

/// Creates a new bucket named `<prefix>-<32 random hex digits>` on the plain-HTTP S3 server at
/// `endpoint`, signed with the credentials in `AWS_ACCESS_KEY_ID` / `AWS_SECRET_ACCESS_KEY`, and
/// returns its name. `prefix` is 1 to 30 lowercase letters, digits or hyphens, starting with a
/// letter or digit (S3's bucket naming, with room for the suffix).
pub fn create_bucket(endpoint: &str, prefix: &str) -> Result<String> {
    let valid = (1..=30).contains(&prefix.len())
        && prefix.starts_with(|c: char| c.is_ascii_lowercase() || c.is_ascii_digit())
        && prefix
            .chars()
            .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '-');
    if !valid {
        return Err(Error::new(
            ErrorKind::InvalidInput,
            format!(
                "bucket prefix {prefix:?}: expected 1 to 30 lowercase letters, digits or \
                 hyphens, starting with a letter or digit"
            ),
        ));
    }
    let bucket = format!("{prefix}-{}", uuid::Uuid::new_v4().simple());
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
        .with_bucket_name(&bucket)
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
    if response.starts_with("HTTP/1.1 200") {
        Ok(bucket)
    } else {
        Err(Error::other(format!(
            "{endpoint}: creating bucket {bucket} refused: {}",
            response.trim()
        )))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn refuses_a_prefix_that_would_make_an_invalid_bucket_name() {
        for prefix in ["", "Upper", "-lead", "under_score", &"x".repeat(31)] {
            let err = create_bucket("http://127.0.0.1:1", prefix).unwrap_err();
            assert_eq!(err.kind(), ErrorKind::InvalidInput, "{prefix:?}: {err}");
            assert!(err.to_string().contains("bucket prefix"), "{err}");
        }
    }

    #[test]
    fn tests_that_start_at_once_each_get_a_new_bucket() {
        let Ok(endpoint) = std::env::var("HSLAKE_TEST_S3_ENDPOINT") else {
            eprintln!(
                "skipped: HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts an S3 server)"
            );
            return;
        };
        // As tests/fault_proxy's 13 S3 tests start: one prefix, all at once.
        let names: Vec<String> = std::thread::scope(|s| {
            let calls: Vec<_> = (0..13)
                .map(|_| s.spawn(|| create_bucket(&endpoint, "hslake-at-once")))
                .collect();
            calls
                .into_iter()
                .map(|c| c.join().unwrap().expect("test bucket"))
                .collect()
        });
        let distinct: std::collections::HashSet<&String> = names.iter().collect();
        assert_eq!(distinct.len(), names.len(), "{names:?}");
        assert!(names
            .iter()
            .all(|n| n.starts_with("hslake-at-once-") && n.len() == 47));
    }
}
