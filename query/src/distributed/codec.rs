//! How our execution plan nodes travel from a coordinator to its workers.
//!
//! DataFusion's protobuf form carries everything of a plan but the nodes it does not know; the
//! one node of ours is the scan of a dataset's shards, `ShardScanExec`, whose child (the Parquet
//! scan) DataFusion encodes itself. What the node adds is where the files are: the dataset's
//! URL and the name the coordinator registered its store under, which carries the URL too. On
//! the worker, the task's registry (one per task, so two coordinators' names never meet) opens
//! the store from that name when the Parquet scan asks for it, only for a dataset under the
//! worker's allowed roots and only to read its shards ([`super::roots`]): nothing decoded here
//! is trusted to say what may be read.
//! Functions need nothing here: plans name them, and a worker's session has them all.
use std::sync::Arc;

use datafusion::datasource::object_store::ObjectStoreUrl;
use datafusion::error::{DataFusionError, Result};
use datafusion::execution::TaskContext;
use datafusion::physical_plan::ExecutionPlan;
use datafusion_proto::physical_plan::{PhysicalExtensionCodec, PhysicalProtoConverterExtension};
use serde::{Deserialize, Serialize};

use crate::table::{ScanSource, ShardScanExec};

/// The codec of our plan nodes, given to the coordinator's and the workers' sessions.
#[derive(Debug, Clone, Copy)]
pub struct HslakeCodec;

/// A node as it travels.
#[derive(Debug, PartialEq, Serialize, Deserialize)]
enum Node {
    ShardScan {
        dataset_url: String,
        store_url: String,
        check_tokens: bool,
    },
}

impl PhysicalExtensionCodec for HslakeCodec {
    fn try_decode(
        &self,
        buf: &[u8],
        inputs: &[Arc<dyn ExecutionPlan>],
        _ctx: &TaskContext,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<Arc<dyn ExecutionPlan>> {
        let node: Node = serde_json::from_slice(buf).map_err(|e| {
            DataFusionError::Internal(format!(
                "hslake plan node: {e}; expected one this version of hslake writes (is every \
                 worker the same version as the coordinator?)"
            ))
        })?;
        match node {
            Node::ShardScan {
                dataset_url,
                store_url,
                check_tokens,
            } => {
                let [input] = inputs else {
                    return Err(DataFusionError::Internal(format!(
                        "ShardScanExec: {} inputs, expected one",
                        inputs.len()
                    )));
                };
                let store_url = ObjectStoreUrl::parse(&store_url)?;
                let source = ScanSource {
                    dataset_url,
                    store_url,
                };
                Ok(Arc::new(ShardScanExec::new(
                    Arc::clone(input),
                    check_tokens,
                    source,
                )))
            }
        }
    }

    fn try_encode(
        &self,
        node: Arc<dyn ExecutionPlan>,
        buf: &mut Vec<u8>,
        _proto_converter: &dyn PhysicalProtoConverterExtension,
    ) -> Result<()> {
        let Some(scan) = node.downcast_ref::<ShardScanExec>() else {
            return Err(DataFusionError::NotImplemented(format!(
                "{}: not a node a distributed hslake query can send to a worker",
                node.name()
            )));
        };
        let wire = Node::ShardScan {
            dataset_url: scan.source().dataset_url.clone(),
            store_url: scan.source().store_url.as_str().to_string(),
            check_tokens: scan.check_tokens(),
        };
        serde_json::to_writer(buf, &wire).map_err(|e| DataFusionError::External(Box::new(e)))
    }
}
