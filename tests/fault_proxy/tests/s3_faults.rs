//! Each fault class as a real S3 client (object_store) sees it, through the proxy in front of
//! moto_server. Skipped without `HSLAKE_TEST_S3_ENDPOINT` (scripts/test.sh starts moto).

mod support;

use std::io::Write;
use std::time::Duration;

use bytes::Bytes;
use hslake_fault_proxy::{DelayPoint, Fault, FaultProxy, Rule, RuleSet};
use hslake_store::tools::s3_bucket::create_bucket;
use object_store::aws::{AmazonS3, AmazonS3Builder};
use object_store::path::Path;
use object_store::signer::Signer;
use object_store::{
    BackoffConfig, ClientOptions, ObjectStore, ObjectStoreExt, PutMode, PutOptions, RetryConfig,
    WriteMultipart,
};
use support::RawConn;

/// A proxy in front of moto and an S3 client pointed at it, with keys and a bucket of its own.
struct Setup {
    proxy: FaultProxy,
    upstream: String,
    /// This test's bucket: tests run at once, and never create one bucket together.
    bucket: String,
    prefix: String,
}

impl Setup {
    fn new() -> Option<Self> {
        let Ok(upstream) = std::env::var("HSLAKE_TEST_S3_ENDPOINT") else {
            eprintln!(
                "skipped: HSLAKE_TEST_S3_ENDPOINT is not set (scripts/test.sh starts an S3 server)"
            );
            return None;
        };
        let bucket = create_bucket(&upstream, "hslake-fault-proxy").expect("test bucket");
        Some(Setup {
            proxy: FaultProxy::start(&upstream).unwrap(),
            upstream,
            bucket,
            prefix: uuid::Uuid::new_v4().simple().to_string(),
        })
    }

    /// A client of the proxy with `retries` retries and a per-request `timeout`.
    fn client(&self, retries: usize, timeout: Duration) -> AmazonS3 {
        client(&self.proxy.endpoint(), &self.bucket, retries, timeout)
    }

    /// A client that talks to moto directly, to see what really landed.
    fn direct(&self) -> AmazonS3 {
        client(&self.upstream, &self.bucket, 0, Duration::from_secs(30))
    }

    fn path(&self, name: &str) -> Path {
        Path::from(format!("{}/{name}", self.prefix))
    }

    fn addr(&self) -> String {
        self.proxy.addr().to_string()
    }

    fn rules(&self, rules: Vec<Rule>) {
        self.proxy.set_rules(&RuleSet::new(rules)).unwrap();
    }
}

fn client(endpoint: &str, bucket: &str, retries: usize, timeout: Duration) -> AmazonS3 {
    AmazonS3Builder::new()
        .with_endpoint(endpoint)
        .with_bucket_name(bucket)
        .with_region("us-east-1")
        .with_access_key_id("testing")
        .with_secret_access_key("testing")
        .with_retry(RetryConfig {
            max_retries: retries,
            retry_timeout: Duration::from_secs(60),
            backoff: BackoffConfig {
                init_backoff: Duration::from_millis(10),
                max_backoff: Duration::from_millis(100),
                base: 2.0,
            },
        })
        // Client options replace one another whole, so allow_http goes in with the timeout.
        .with_client_options(
            ClientOptions::new()
                .with_allow_http(true)
                .with_timeout(timeout),
        )
        .build()
        .unwrap()
}

fn payload(len: usize, seed: u8) -> Bytes {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

const LONG: Duration = Duration::from_secs(30);

#[tokio::test]
async fn slow_down_503_is_retried_by_the_client_and_the_put_lands() {
    let Some(t) = Setup::new() else { return };
    t.rules(vec![Rule::new(Fault::slow_down())
        .name("throttle")
        .method("PUT")
        .nth(1, 2)]);
    let path = t.path("a.bin");
    let data = payload(1000, 1);
    t.client(3, LONG)
        .put(&path, data.clone().into())
        .await
        .unwrap();
    let c = t.proxy.counters();
    assert_eq!(c.class("status_503"), 2);
    assert_eq!(
        c.rule("throttle").unwrap().matched,
        3,
        "two refused, one forwarded"
    );
    let got = t.direct().get(&path).await.unwrap().bytes().await.unwrap();
    assert_eq!(got, data);
}

#[tokio::test]
async fn internal_error_500_reaches_the_client_once_retries_run_out() {
    let Some(t) = Setup::new() else { return };
    let path = t.path("b.bin");
    t.direct().put(&path, payload(10, 2).into()).await.unwrap();
    t.rules(vec![Rule::new(Fault::internal_error()).method("GET")]);
    let err = t.client(2, LONG).get(&path).await.unwrap_err().to_string();
    assert!(
        err.contains("500") && err.contains("InternalError"),
        "{err}"
    );
    assert_eq!(
        t.proxy.counters().class("status_500"),
        3,
        "one try and two retries"
    );
}

#[tokio::test]
async fn reset_after_on_a_conditional_put_applies_it_although_the_client_saw_an_error() {
    let Some(t) = Setup::new() else { return };
    t.rules(vec![Rule::new(Fault::ResetAfter)
        .name("lost-commit")
        .method("PUT")
        .key(r"_hslake/versions/.*\.json$")
        .header("If-None-Match")
        .nth(1, 2)]);
    let create = PutOptions {
        mode: PutMode::Create,
        ..Default::default()
    };

    // Without retries the client reports a failure for a write that happened.
    let manifest = t.path("_hslake/versions/00000001.json");
    let data = payload(300, 3);
    let res = t
        .client(0, LONG)
        .put_opts(&manifest, data.clone().into(), create.clone())
        .await;
    assert!(res.is_err(), "the client never heard back: {res:?}");
    let landed = t
        .direct()
        .get(&manifest)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(landed, data, "the store applied the write");

    // object_store does not retry it either (a conditional put is not idempotent): the
    // reset comes back although the write landed.
    let manifest = t.path("_hslake/versions/00000002.json");
    let err = t
        .client(3, LONG)
        .put_opts(&manifest, data.clone().into(), create.clone())
        .await
        .unwrap_err();
    let detail = format!("{err:?}");
    assert!(
        detail.contains("ConnectionReset") && detail.contains("retries: 0"),
        "{detail}"
    );
    assert!(t.direct().head(&manifest).await.is_ok());

    // A caller that simply retries meets its own object: 412, the classic commit failure.
    let err = t
        .client(3, LONG)
        .put_opts(&manifest, data.clone().into(), create)
        .await
        .unwrap_err();
    assert!(
        matches!(err, object_store::Error::AlreadyExists { .. }),
        "{err:?}"
    );

    // An unconditional put of the same key is not what the rule matches.
    t.client(0, LONG).put(&manifest, data.into()).await.unwrap();
    let c = t.proxy.counters();
    assert_eq!(c.class("reset_after"), 2);
    assert_eq!(c.rule("lost-commit").unwrap().matched, 3);
    assert_eq!(
        c.requests, 4,
        "three conditional puts and one plain put, none retried"
    );
}

#[tokio::test]
async fn reset_before_never_reaches_the_store() {
    let Some(t) = Setup::new() else { return };
    t.rules(vec![Rule::new(Fault::ResetBefore).method("PUT").nth(1, 1)]);
    let path = t.path("c.bin");
    let res = t.client(0, LONG).put(&path, payload(5000, 4).into()).await;
    assert!(res.is_err(), "{res:?}");
    assert!(matches!(
        t.direct().head(&path).await,
        Err(object_store::Error::NotFound { .. })
    ));
    assert_eq!(t.proxy.counters().class("reset_before"), 1);
    // The next attempt (match 2) goes through.
    t.client(0, LONG)
        .put(&path, payload(5000, 4).into())
        .await
        .unwrap();
    assert!(t.direct().head(&path).await.is_ok());
}

#[tokio::test]
async fn truncated_body_is_an_error_for_the_client_never_short_data() {
    let Some(t) = Setup::new() else { return };
    let path = t.path("d.bin");
    t.direct()
        .put(&path, payload(64 * 1024, 5).into())
        .await
        .unwrap();
    t.rules(vec![
        Rule::new(Fault::Truncate { bytes: None }).method("GET")
    ]);
    let res = match t.client(0, LONG).get(&path).await {
        Ok(r) => r.bytes().await,
        Err(e) => Err(e),
    };
    assert!(res.is_err(), "a cut body must not pass as data: {res:?}");
    assert!(t.proxy.counters().class("truncate") >= 1);
}

#[tokio::test]
async fn truncate_sends_the_headers_then_exactly_the_first_bytes() {
    let Some(t) = Setup::new() else { return };
    let path = t.path("e.bin");
    let data = payload(10_000, 6);
    t.direct().put(&path, data.clone().into()).await.unwrap();
    t.rules(vec![Rule::new(Fault::Truncate { bytes: Some(1234) })]);
    // S3 servers refuse anonymous reads; a presigned URL carries the credentials in its query.
    let url = t
        .client(0, LONG)
        .signed_url(http::Method::GET, &path, Duration::from_secs(600))
        .await
        .unwrap();
    let target = format!("{}?{}", url.path(), url.query().unwrap_or_default());
    let mut conn = RawConn::connect(&t.addr());
    let resp = conn.request("GET", &target, b"");
    assert_eq!(resp.status, 200);
    assert_eq!(resp.header("content-length"), Some("10000"));
    assert!(!resp.complete);
    assert_eq!(resp.body, data[..1234]);
    assert!(conn.is_closed());
}

#[tokio::test]
async fn delay_before_beyond_the_client_timeout_is_retried() {
    let Some(t) = Setup::new() else { return };
    let path = t.path("f.bin");
    t.direct().put(&path, payload(100, 7).into()).await.unwrap();
    t.rules(vec![Rule::new(Fault::Delay {
        ms: 5_000,
        when: DelayPoint::Before,
    })
    .method("GET")
    .nth(1, 1)]);
    let got = t
        .client(2, Duration::from_millis(500))
        .get(&path)
        .await
        .unwrap()
        .bytes()
        .await
        .unwrap();
    assert_eq!(got, payload(100, 7));
    assert_eq!(t.proxy.counters().class("delay"), 1);
}

#[tokio::test]
async fn delay_after_beyond_the_client_timeout_loses_the_answer_of_an_applied_put() {
    let Some(t) = Setup::new() else { return };
    // SeaweedFS grows a volume on the first write into a bucket, which can outlast the 500 ms
    // timeout below; the client's hang-up then cancels the put before it is applied.
    t.direct()
        .put(&t.path("warm-up"), payload(1, 8).into())
        .await
        .unwrap();
    t.rules(vec![Rule::new(Fault::Delay {
        ms: 5_000,
        when: DelayPoint::After,
    })
    .method("PUT")]);
    let path = t.path("g.bin");
    let res = t
        .client(0, Duration::from_millis(500))
        .put(&path, payload(100, 8).into())
        .await;
    assert!(res.is_err(), "{res:?}");
    assert!(
        t.direct().head(&path).await.is_ok(),
        "applied before the delay"
    );
}

#[tokio::test]
async fn rules_by_key_regex_fire_only_on_matching_keys() {
    let Some(t) = Setup::new() else { return };
    t.rules(vec![Rule::new(Fault::slow_down())
        .name("manifests")
        .key(r"/_hslake/versions/\d+\.json$")]);
    let s3 = t.client(0, LONG);
    s3.put(&t.path("data/0.parquet"), payload(10, 9).into())
        .await
        .unwrap();
    s3.put(
        &t.path("_hslake/versions/x.json.tmp"),
        payload(10, 9).into(),
    )
    .await
    .unwrap();
    let err = s3
        .put(
            &t.path("_hslake/versions/00000001.json"),
            payload(10, 9).into(),
        )
        .await
        .unwrap_err();
    assert!(err.to_string().contains("SlowDown"), "{err}");
    let c = t.proxy.counters();
    assert_eq!(c.requests, 3);
    assert_eq!(c.rule("manifests").unwrap().matched, 1);
    assert_eq!(c.class("status_503"), 1);
}

#[tokio::test]
async fn rules_by_count_fire_on_the_nth_to_mth_match_only() {
    let Some(t) = Setup::new() else { return };
    t.rules(vec![Rule::new(Fault::internal_error())
        .method("PUT")
        .nth(2, 3)]);
    let s3 = t.client(0, LONG);
    let mut outcomes = Vec::new();
    for i in 0..4 {
        outcomes.push(
            s3.put(&t.path(&format!("{i}")), payload(10, 0).into())
                .await
                .is_ok(),
        );
    }
    assert_eq!(outcomes, [true, false, false, true]);
    assert_eq!(t.proxy.counters().class("status_500"), 2);
}

#[tokio::test]
async fn random_faults_of_every_class_never_pass_wrong_data() {
    let Some(t) = Setup::new() else { return };
    t.proxy
        .set_rules(
            &RuleSet::new(vec![Rule::new(Fault::Random {
                p: 0.05,
                of: vec![],
            })
            .name("chaos")])
            .seed(42),
        )
        .unwrap();
    let s3 = t.client(10, Duration::from_secs(5));
    let classes: Vec<String> = Fault::every_class().iter().map(Fault::class).collect();
    let (mut rounds, mut ok_reads) = (0, 0);
    // Until every class has been drawn (a few dozen rounds at 5 % each), within a bound.
    while rounds < 20 || classes.iter().any(|c| t.proxy.counters().class(c) == 0) {
        assert!(
            rounds < 400,
            "some class never drawn: {:?}",
            t.proxy.counters()
        );
        let path = t.path(&format!("r{rounds}"));
        let data = payload(20_000 + rounds, rounds as u8);
        // A put may fail although it landed (reset_after); the read decides.
        let _ = s3.put(&path, data.clone().into()).await;
        if let Ok(got) = async { s3.get(&path).await?.bytes().await }.await {
            assert_eq!(got, data, "{path}");
            ok_reads += 1;
        }
        rounds += 1;
    }
    assert!(
        ok_reads * 4 > rounds * 3,
        "only {ok_reads} of {rounds} reads succeeded"
    );
    let c = t.proxy.counters();
    let chaos = c.rule("chaos").unwrap();
    assert_eq!(chaos.matched, c.requests);
    assert_eq!(chaos.faults, c.faults);
    assert_eq!(c.faults.len(), classes.len(), "{:?}", c.faults);
}

#[tokio::test]
async fn multipart_uploads_and_large_bodies_stream_through() {
    let Some(t) = Setup::new() else { return };
    let s3 = t.client(0, LONG);
    let path = t.path("multi.bin");
    let data = payload(12 << 20, 10);
    let mut upload = WriteMultipart::new(s3.put_multipart(&path).await.unwrap());
    for chunk in data.chunks(1 << 20) {
        upload.write(chunk);
    }
    upload.finish().await.unwrap();
    let got = s3.get(&path).await.unwrap().bytes().await.unwrap();
    assert_eq!(got.len(), data.len());
    assert!(got == data);
    let c = t.proxy.counters();
    assert!(c.requests >= 5, "create, 3 parts, complete, get: {c:?}");
    assert_eq!(c.total_faults(), 0);
}

#[tokio::test]
async fn survives_clients_that_leave_mid_body() {
    let Some(t) = Setup::new() else { return };
    let big = t.path("big.bin");
    t.direct()
        .put(&big, payload(4 << 20, 11).into())
        .await
        .unwrap();

    // An upload that stops after 1 MiB of 8 announced, and a download dropped after its head.
    let addr = t.addr();
    let half_put = t.path("half.bin");
    let target = format!("/{}/{half_put}", t.bucket);
    let big_target = format!("/{}/{big}", t.bucket);
    tokio::task::spawn_blocking(move || {
        let mut conn = RawConn::connect(&addr);
        conn.send_head("PUT", &target, 8 << 20, "");
        conn.stream().write_all(&[7u8; 1 << 20]).unwrap();
        drop(conn);
        let mut conn = RawConn::connect(&addr);
        conn.send_head("GET", &big_target, 0, "");
        let _ = conn
            .stream()
            .set_read_timeout(Some(Duration::from_millis(200)));
        let mut head = [0u8; 512];
        let _ = std::io::Read::read(conn.stream(), &mut head);
        drop(conn);
    })
    .await
    .unwrap();

    // The proxy still serves, and the cut upload was not completed upstream.
    let path = t.path("after.bin");
    let s3 = t.client(0, LONG);
    s3.put(&path, payload(3000, 12).into()).await.unwrap();
    let got = s3.get(&path).await.unwrap().bytes().await.unwrap();
    assert_eq!(got, payload(3000, 12));
    assert!(matches!(
        t.direct().head(&t.path("half.bin")).await,
        Err(object_store::Error::NotFound { .. })
    ));
}
