//! A coordinator's connections to its workers: one per worker, made once and reused (tonic
//! reconnects a broken one), each first connect bounded in time, so a worker that cannot be
//! reached fails the query at once with its URL instead of leaving it waiting on TCP.
use std::collections::HashMap;
use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use datafusion::error::DataFusionError;
use datafusion_distributed::grpc::{create_worker_client, BoxCloneSyncChannel};
use datafusion_distributed::{ChannelResolver, WorkerChannel};
use tonic::transport::Channel;
use url::Url;

use crate::QueryError;

/// How long connecting to a worker may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(5);

/// The connections of one coordinator session.
#[derive(Clone, Default)]
pub(crate) struct Channels {
    open: Arc<tokio::sync::Mutex<HashMap<Url, BoxCloneSyncChannel>>>,
}

#[async_trait]
impl ChannelResolver for Channels {
    async fn get_worker_client_for_url(
        &self,
        url: &Url,
    ) -> Result<Box<dyn WorkerChannel>, DataFusionError> {
        let mut open = self.open.lock().await;
        if let Some(c) = open.get(url) {
            return Ok(create_worker_client(c.clone()));
        }
        let failed = |what: &str, e: &dyn std::error::Error| {
            let mut reason = format!("{what}: {e}");
            let mut source = e.source();
            while let Some(s) = source {
                reason.push_str(&format!(": {s}"));
                source = s.source();
            }
            DataFusionError::External(Box::new(QueryError::Worker {
                url: url.to_string(),
                reason,
            }))
        };
        let channel = Channel::from_shared(url.to_string())
            .map_err(|e| failed("not a worker URL", &e))?
            .connect_timeout(CONNECT_TIMEOUT)
            .connect()
            .await
            .map_err(|e| failed("cannot connect", &e))?;
        let channel = BoxCloneSyncChannel::new(channel);
        open.insert(url.clone(), channel.clone());
        Ok(create_worker_client(channel))
    }
}
