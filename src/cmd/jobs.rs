//! `hslake jobs`: the client of `hslake serve-capture`'s job API.
use std::path::PathBuf;
use std::process::ExitCode;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use reqwest::{Method, StatusCode};
use serde_json::Value;

use super::capture_job::JobArgs;
use hslake_schemas::units::DurationRange;

/// `jobs wait --timeout`: a millisecond up to a year.
const WAIT_TIMEOUT: DurationRange =
    DurationRange::seconds("--timeout", Duration::from_millis(1), super::YEAR);

/// Submit, list, show, cancel and wait for capture jobs on a daemon.
#[derive(clap::Args, Debug)]
pub struct Args {
    /// The daemon, e.g. http://127.0.0.1:8470.
    #[arg(
        long,
        global = true,
        env = "HSLAKE_SERVER",
        default_value = "http://127.0.0.1:8470"
    )]
    pub server: String,
    /// File holding the bearer token (first line); else the HSLAKE_TOKEN environment variable.
    #[arg(long, global = true)]
    pub token_file: Option<PathBuf>,
    /// What to do.
    #[command(subcommand)]
    pub command: JobsCommand,
}

/// One `hslake jobs` verb.
#[derive(clap::Subcommand, Debug)]
pub enum JobsCommand {
    /// Queue a capture job (the flags of `hslake capture` that say what to capture and where);
    /// prints its id.
    Submit(JobArgs),
    /// List every job with its state and progress (fetched a page at a time).
    Ls {
        /// Only jobs in these states, e.g. queued,running.
        #[arg(long)]
        state: Option<String>,
    },
    /// Print one job as JSON.
    Show {
        /// The job id.
        id: u64,
    },
    /// Cancel a job: a queued one never runs; a running one commits what it captured.
    Cancel {
        /// The job id.
        id: u64,
    },
    /// Wait until a job ends; exit 0 when it is done, 1 when it failed or was cancelled.
    Wait {
        /// The job id.
        id: u64,
        /// Give up (exit 2) after this long, e.g. 30m.
        #[arg(long, value_parser = WAIT_TIMEOUT.parser())]
        timeout: Option<Duration>,
    },
}

/// Jobs asked for per page by `ls`.
const LS_PAGE: usize = 500;

/// A connection to one daemon.
struct Client {
    http: reqwest::Client,
    server: String,
    token: String,
}

impl Client {
    async fn call(&self, method: Method, path: &str, body: Option<Value>) -> Result<Value> {
        let url = format!("{}{path}", self.server.trim_end_matches('/'));
        let mut req = self
            .http
            .request(method.clone(), &url)
            .bearer_auth(&self.token);
        if let Some(b) = body {
            req = req
                .header(reqwest::header::CONTENT_TYPE, "application/json")
                .body(b.to_string());
        }
        let resp = req
            .send()
            .await
            .with_context(|| format!("{method} {url}: is `hslake serve-capture` running there?"))?;
        let status = resp.status();
        let text = resp
            .text()
            .await
            .with_context(|| format!("{method} {url}: reading the answer"))?;
        let value: Value = serde_json::from_str(&text).unwrap_or(Value::String(text));
        if !status.is_success() {
            let msg = value
                .get("error")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| value.to_string());
            if status == StatusCode::UNAUTHORIZED {
                bail!("{method} {url}: {status}: {msg} (check --token-file or HSLAKE_TOKEN)");
            }
            bail!("{method} {url}: {status}: {msg}");
        }
        Ok(value)
    }
}

/// The token from `--token-file`, else from HSLAKE_TOKEN.
fn token(file: Option<&PathBuf>) -> Result<String> {
    if let Some(f) = file {
        return super::read_token_file(f);
    }
    match std::env::var("HSLAKE_TOKEN") {
        Ok(t) if !t.trim().is_empty() => Ok(t.trim().to_string()),
        _ => bail!("no token: pass --token-file or set HSLAKE_TOKEN"),
    }
}

/// Local paths are the client's: the daemon runs elsewhere, so they go out absolute, and the
/// output as the dataset URL every command would read the same string as.
fn absolute(mut spec: JobArgs) -> Result<JobArgs> {
    if !spec.input.to_string_lossy().contains("://") {
        spec.input = std::path::absolute(&spec.input)
            .with_context(|| format!("--input {}", spec.input.display()))?;
    }
    spec.output = hslake_store::location::dataset_url(&spec.output)
        .with_context(|| format!("--output {}", spec.output))?;
    Ok(spec)
}

/// Runs one `hslake jobs` verb.
pub async fn run(a: Args) -> Result<ExitCode> {
    let client = Client {
        http: reqwest::Client::builder()
            .connect_timeout(Duration::from_secs(10))
            .build()
            .context("starting the HTTP client")?,
        server: a.server.clone(),
        token: token(a.token_file.as_ref())?,
    };
    match a.command {
        JobsCommand::Submit(spec) => {
            let spec = absolute(spec)?;
            let v = client
                .call(Method::POST, "/v1/jobs", Some(serde_json::to_value(&spec)?))
                .await?;
            println!("{}", v["id"]);
            Ok(ExitCode::SUCCESS)
        }
        JobsCommand::Ls { state } => {
            println!(
                "{:>6}  {:<9}  {:>17}  {:>10}  output",
                "id", "state", "samples", "tokens/s"
            );
            let filter = state.map(|s| format!("&state={s}")).unwrap_or_default();
            let mut after = 0;
            loop {
                let path = format!("/v1/jobs?limit={LS_PAGE}&after={after}{filter}");
                let v = client.call(Method::GET, &path, None).await?;
                for j in v["jobs"].as_array().into_iter().flatten() {
                    println!(
                        "{:>6}  {:<9}  {:>17}  {:>10.0}  {}",
                        j["id"],
                        j["state"].as_str().unwrap_or("?"),
                        format!("{}/{}", j["samples_done"], j["samples_total"]),
                        j["tokens_per_s"].as_f64().unwrap_or(0.0),
                        j["output"].as_str().unwrap_or("?"),
                    );
                }
                match v["next"].as_u64() {
                    Some(next) => after = next,
                    None => break,
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        JobsCommand::Show { id } => {
            let v = client
                .call(Method::GET, &format!("/v1/jobs/{id}"), None)
                .await?;
            println!("{}", serde_json::to_string_pretty(&v)?);
            Ok(ExitCode::SUCCESS)
        }
        JobsCommand::Cancel { id } => {
            let v = client
                .call(Method::DELETE, &format!("/v1/jobs/{id}"), None)
                .await?;
            println!("job {id}: {}", v["state"].as_str().unwrap_or("?"));
            Ok(ExitCode::SUCCESS)
        }
        JobsCommand::Wait { id, timeout } => wait(&client, id, timeout).await,
    }
}

/// Polls a job until it ends, logging progress when it changes.
async fn wait(client: &Client, id: u64, timeout: Option<Duration>) -> Result<ExitCode> {
    let start = Instant::now();
    let mut last = None;
    loop {
        // A restarting daemon refuses connections for a while: keep waiting through that.
        let v = match client
            .call(Method::GET, &format!("/v1/jobs/{id}"), None)
            .await
        {
            Ok(v) => v,
            Err(e) if e.chain().any(|c| c.is::<reqwest::Error>()) => {
                tracing::warn!("{e:#}; retrying");
                Value::Null
            }
            Err(e) => return Err(e),
        };
        let state = v["state"].as_str().unwrap_or("").to_string();
        let seen = (state.clone(), v["samples_done"].clone());
        if !state.is_empty() && last.as_ref() != Some(&seen) {
            tracing::info!(
                "job {id}: {state}, {}/{} samples",
                v["samples_done"],
                v["samples_total"]
            );
            last = Some(seen);
        }
        match state.as_str() {
            "done" => {
                println!("{}", serde_json::to_string_pretty(&v)?);
                return Ok(ExitCode::SUCCESS);
            }
            "failed" | "cancelled" => {
                println!("{}", serde_json::to_string_pretty(&v)?);
                eprintln!(
                    "job {id} {state}{}",
                    v["error"]
                        .as_str()
                        .map(|e| format!(": {e}"))
                        .unwrap_or_default()
                );
                return Ok(ExitCode::FAILURE);
            }
            _ => {}
        }
        if timeout.is_some_and(|t| start.elapsed() >= t) {
            eprintln!("job {id} still {state} after {:?}", start.elapsed());
            return Ok(ExitCode::from(2));
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

#[cfg(test)]
mod tests {
    use clap::Parser;

    use super::*;

    /// `hslake jobs submit` as the command line gives it.
    #[derive(Parser)]
    struct Submit {
        #[command(flatten)]
        job: JobArgs,
    }

    fn submitted(output: &str) -> JobArgs {
        let args = [
            "submit", "--input", "in.jsonl", "--output", output, "--layers", "0",
        ];
        Submit::try_parse_from(args).unwrap().job
    }

    #[test]
    fn a_job_goes_out_with_the_output_every_command_reads_and_never_the_root() {
        for given in ["ds", "./ds/", "/tmp/ds/", "s3://bucket/ds/"] {
            let sent = absolute(submitted(given)).unwrap();
            // What the daemon's capture opens the string as.
            let opened = hslake_store::location::parse_dataset(given).unwrap().url;
            assert_eq!(sent.output, opened, "{given}");
            assert!(sent.input.is_absolute());
        }
        for root in ["/", "file:///", "s3://bucket"] {
            let err = format!("{:#}", absolute(submitted(root)).unwrap_err());
            assert!(err.contains("is the root of a"), "{root}: {err}");
        }
    }
}
