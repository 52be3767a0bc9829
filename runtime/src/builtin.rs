//! Diagnostic actors every node can spawn: `echo` and `bulk-sink`. They let operators
//! and tests check a cluster end to end without any ML role loaded.

use serde::{Deserialize, Serialize};

use crate::actor::{Actor, ActorError, Context};
use crate::message::WithBulk;
use crate::node::NodeBuilder;

/// Answers every request with the request itself.
pub struct Echo;

impl Actor for Echo {
    type Request = Vec<u8>;
    type Response = Vec<u8>;
    async fn handle(&mut self, request: Vec<u8>, _: &mut Context) -> Result<Vec<u8>, ActorError> {
        Ok(request)
    }
}

/// What [`BulkSink`] answers: the label it got, the crc32 and length of the bytes.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct BulkReceipt {
    /// The label sent with the batch.
    pub label: String,
    /// crc32 of the whole bulk payload.
    pub crc32: u32,
    /// Bytes received.
    pub bytes: u64,
    /// Tensors received.
    pub tensors: usize,
}

/// Reads every byte of a bulk payload and answers its checksum.
pub struct BulkSink;

impl Actor for BulkSink {
    type Request = WithBulk<String>;
    type Response = BulkReceipt;
    async fn handle(
        &mut self,
        r: WithBulk<String>,
        _: &mut Context,
    ) -> Result<BulkReceipt, ActorError> {
        Ok(BulkReceipt {
            label: r.meta,
            crc32: r.bulk.checksum(),
            bytes: r.bulk.len(),
            tensors: r.bulk.header().tensors.len(),
        })
    }
}

/// Registers `echo` and `bulk-sink` (no arguments) with a node builder.
pub fn register(builder: NodeBuilder) -> NodeBuilder {
    builder
        .factory("echo", |_: ()| Ok(Echo))
        .factory("bulk-sink", |_: ()| Ok(BulkSink))
}
