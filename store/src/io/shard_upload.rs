//! A shard on its way to storage: Parquet encodes each row group into reused fixed-size
//! chunks, which go to the object store as they are (no copy), with a running CRC-32C and
//! length of every byte sent.
//!
//! Why not parquet's `AsyncArrowWriter`: it encodes each row group into a fresh `Vec` grown by
//! doubling, then the object store's `AsyncWrite` path copies it once more. A row group of
//! real-size states is one sample of tens of MB, so every row group cost two extra copies, a
//! dozen reallocations and a fresh `mmap` (page faults; an `munmap` when freed, which
//! interrupts every other thread of the process). Here the chunks come back to a small pool,
//! which outlives each shard (a dataset writer keeps one for all the shards it writes), once
//! the store has written them.
use std::io::Write;
use std::sync::{Arc, Mutex};

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use bytes::Bytes;
use object_store::buffered::BufWriter;
use parquet::arrow::ArrowWriter;
use parquet::errors::ParquetError;
use parquet::file::properties::WriterProperties;

/// Bytes of one chunk: a few object-store parts in flight hold a few of them.
const CHUNK: usize = 4 << 20;

/// Chunks kept for reuse (per pool): enough for a row group of real-size states in flight,
/// few enough that an idle writer holds little.
const POOL: usize = 16;

/// Chunks for [`ShardUpload`]s to reuse: one per dataset writer, shared by its shards in turn.
#[derive(Clone, Default)]
pub struct ChunkPool(Arc<Mutex<Vec<Vec<u8>>>>);

/// A chunk on loan to the object store; back to the pool when the store drops it.
struct Loaned {
    bytes: Vec<u8>,
    pool: ChunkPool,
}

impl AsRef<[u8]> for Loaned {
    fn as_ref(&self) -> &[u8] {
        &self.bytes
    }
}

impl Drop for Loaned {
    fn drop(&mut self) {
        let mut bytes = std::mem::take(&mut self.bytes);
        bytes.clear();
        if let Ok(mut pool) = self.pool.0.lock() {
            if pool.len() < POOL {
                pool.push(bytes);
            }
        }
    }
}

/// Where Parquet writes: fills chunks from the pool, seals full ones for sending.
struct ChunkSink {
    current: Vec<u8>,
    sealed: Vec<Bytes>,
    pool: ChunkPool,
}

impl ChunkSink {
    fn seal(&mut self) {
        if self.current.is_empty() {
            return;
        }
        let bytes = std::mem::take(&mut self.current);
        self.sealed.push(Bytes::from_owner(Loaned {
            bytes,
            pool: self.pool.clone(),
        }));
    }

    /// Everything written so far, as chunks to send (the last one partly filled).
    fn take(&mut self) -> Vec<Bytes> {
        self.seal();
        std::mem::take(&mut self.sealed)
    }
}

impl Write for ChunkSink {
    fn write(&mut self, mut buf: &[u8]) -> std::io::Result<usize> {
        let n = buf.len();
        while !buf.is_empty() {
            if self.current.capacity() == 0 {
                let reused = self.pool.0.lock().ok().and_then(|mut p| p.pop());
                self.current = reused.unwrap_or_else(|| Vec::with_capacity(CHUNK));
            }
            let room = self.current.capacity() - self.current.len();
            let (now, rest) = buf.split_at(room.min(buf.len()));
            self.current.extend_from_slice(now);
            buf = rest;
            if self.current.len() == self.current.capacity() {
                self.seal();
            }
        }
        Ok(n)
    }

    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// One shard file being written: row groups in, bytes to the object store.
pub struct ShardUpload {
    writer: ArrowWriter<ChunkSink>,
    out: BufWriter,
    crc: u32,
    bytes: u64,
}

impl ShardUpload {
    /// A shard of `schema` written with `props` through `out`, in chunks of `pool`.
    pub fn new(
        out: BufWriter,
        schema: SchemaRef,
        props: WriterProperties,
        pool: ChunkPool,
    ) -> Result<Self, ParquetError> {
        let sink = ChunkSink {
            current: Vec::new(),
            sealed: Vec::new(),
            pool,
        };
        Ok(ShardUpload {
            writer: ArrowWriter::try_new(sink, schema, Some(props))?,
            out,
            crc: 0,
            bytes: 0,
        })
    }

    /// Writes `batch` as one row group and sends it.
    pub async fn write_row_group(&mut self, batch: &RecordBatch) -> Result<(), ParquetError> {
        self.writer.write(batch)?;
        self.writer.flush()?;
        self.send().await
    }

    /// Writes the footer, sends it and completes the upload.
    pub async fn finish(&mut self) -> Result<(), ParquetError> {
        self.writer.finish()?;
        self.send().await?;
        tokio::io::AsyncWriteExt::shutdown(&mut self.out)
            .await
            .map_err(|e| ParquetError::External(Box::new(e)))
    }

    /// Bytes of the file so far (sent or about to be).
    pub fn bytes_written(&self) -> usize {
        self.writer.bytes_written()
    }

    /// CRC-32C and length of the bytes sent to the object store.
    pub fn digest(&self) -> (u32, u64) {
        (self.crc, self.bytes)
    }

    async fn send(&mut self) -> Result<(), ParquetError> {
        for chunk in self.writer.inner_mut().take() {
            self.crc = crc32c::crc32c_append(self.crc, &chunk);
            self.bytes += chunk.len() as u64;
            self.out
                .put(chunk)
                .await
                .map_err(|e| ParquetError::External(Box::new(e)))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_sink_hands_out_exactly_what_was_written_in_full_chunks_and_reuses_them() {
        let mut sink = ChunkSink {
            current: Vec::new(),
            sealed: Vec::new(),
            pool: ChunkPool::default(),
        };
        let data: Vec<u8> = (0..(CHUNK * 2 + 1000))
            .map(|i| (i * 7 % 251) as u8)
            .collect();
        sink.write_all(&data[..10]).unwrap();
        sink.write_all(&data[10..]).unwrap();
        let chunks = sink.take();
        assert_eq!(
            chunks.iter().map(Bytes::len).collect::<Vec<_>>(),
            [CHUNK, CHUNK, 1000]
        );
        assert_eq!(chunks.concat(), data);
        assert!(
            sink.take().is_empty(),
            "taken chunks are not handed out twice"
        );
        drop(chunks);
        assert_eq!(
            sink.pool.0.lock().unwrap().len(),
            3,
            "sent chunks return to the pool"
        );
        sink.write_all(&data[..5]).unwrap();
        assert_eq!(
            sink.pool.0.lock().unwrap().len(),
            2,
            "the next write reuses one"
        );
        assert_eq!(sink.take().concat(), &data[..5]);
    }
}
