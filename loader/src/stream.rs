//! The consumer's end of the pipeline: batches in order from the reading task, and the state
//! after each.
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::{Batch, LoaderError, LoaderState};

/// What the reading task sends a stream, in order.
pub(crate) enum Msg {
    /// A batch being assembled.
    Batch(JoinHandle<Batch>),
    /// The pass failed.
    Error(LoaderError),
    /// The pass ended; the state to start the next from.
    End(LoaderState),
}

/// Batches of one pass (an epoch, or in follow mode until no new version arrives), in order.
pub struct BatchStream {
    rx: mpsc::Receiver<Msg>,
    driver: JoinHandle<()>,
    state: LoaderState,
    done: bool,
}

impl BatchStream {
    /// The stream of what `driver` sends over `rx`, from `state`.
    pub(crate) fn new(rx: mpsc::Receiver<Msg>, driver: JoinHandle<()>, state: LoaderState) -> Self {
        BatchStream {
            rx,
            driver,
            state,
            done: false,
        }
    }

    /// The next batch; `None` at the end of the pass.
    pub async fn next(&mut self) -> Option<Result<Batch, LoaderError>> {
        if self.done {
            return None;
        }
        let msg = self.rx.recv().await;
        match msg {
            Some(Msg::Batch(h)) => match h.await {
                Ok(b) => {
                    self.state = b.state.clone();
                    Some(Ok(b))
                }
                Err(e) => {
                    self.done = true;
                    Some(Err(LoaderError::Pipeline(format!(
                        "batch assembly failed: {e}"
                    ))))
                }
            },
            Some(Msg::Error(e)) => {
                self.done = true;
                Some(Err(e))
            }
            Some(Msg::End(next)) => {
                self.done = true;
                self.state = next;
                None
            }
            None => {
                self.done = true;
                Some(Err(LoaderError::Pipeline(
                    "the reading task stopped without a reason".into(),
                )))
            }
        }
    }

    /// [`BatchStream::next`] for synchronous callers; must not be called on a runtime thread.
    pub fn blocking_next(&mut self) -> Option<Result<Batch, LoaderError>> {
        futures::executor::block_on(self.next())
    }

    /// The state after the last batch delivered (after the end: the start of the next pass).
    pub fn state(&self) -> &LoaderState {
        &self.state
    }
}

impl Drop for BatchStream {
    fn drop(&mut self) {
        self.driver.abort();
    }
}
