//! The Parquet decoder run on bytes that may be corrupt. parquet 59 asserts on some malformed
//! input instead of returning an error (a page header whose encoding a flipped bit turned into
//! a dictionary encoding; a footer length past the file, in the metadata decoder DataFusion
//! uses), so every decode of a shard runs through here: a panic inside becomes an error
//! message, and is not printed as a panic.
use std::any::Any;
use std::cell::Cell;
use std::future::Future;
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Once;
use std::task::Poll;

use futures::Stream;

thread_local! {
    /// This thread is inside [`guarded`]: a panic here is reported as an error instead.
    static GUARDED: Cell<bool> = const { Cell::new(false) };
}

/// Wraps the process's panic hook once, so that it stays silent for guarded panics only.
fn quiet_guarded_panics() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if !GUARDED.with(Cell::get) {
                previous(info)
            }
        }));
    });
}

/// The text a panic was raised with.
fn message(payload: Box<dyn Any + Send>) -> String {
    match payload.downcast::<String>() {
        Ok(s) => *s,
        Err(p) => match p.downcast::<&'static str>() {
            Ok(s) => (*s).to_string(),
            Err(_) => "a panic without a message".to_string(),
        },
    }
}

/// What a shard's decoding that panicked with `message` is reported as.
pub fn decoder_failure(message: &str) -> String {
    format!("the Parquet decoder failed: {message}")
}

/// Runs `f`; a panic inside it is returned as its message.
pub fn guarded<T>(f: impl FnOnce() -> T) -> Result<T, String> {
    quiet_guarded_panics();
    let was = GUARDED.with(|g| g.replace(true));
    let result = catch_unwind(AssertUnwindSafe(f));
    GUARDED.with(|g| g.set(was));
    result.map_err(message)
}

/// Runs `fut` with each poll [`guarded`]: a panic while polling ends it with the message.
pub async fn guarded_async<F: Future>(fut: F) -> Result<F::Output, String> {
    let mut fut = std::pin::pin!(fut);
    std::future::poll_fn(|cx| match guarded(|| fut.as_mut().poll(cx)) {
        Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
        Ok(Poll::Pending) => Poll::Pending,
        Err(m) => Poll::Ready(Err(m)),
    })
    .await
}

/// `stream` with each poll [`guarded`]: a panic while polling is its last item, as the message.
pub fn guarded_stream<S: Stream>(stream: S) -> impl Stream<Item = Result<S::Item, String>> {
    let mut stream = Box::pin(stream);
    let mut failed = false;
    futures::stream::poll_fn(move |cx| {
        if failed {
            return Poll::Ready(None);
        }
        match guarded(|| stream.as_mut().poll_next(cx)) {
            Ok(p) => p.map(|item| item.map(Ok)),
            Err(m) => {
                failed = true;
                Poll::Ready(Some(Err(m)))
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_panic_inside_becomes_its_message_and_the_thread_goes_on() {
        assert_eq!(guarded(|| 7), Ok(7));
        let e = guarded(|| -> u8 { panic!("decoder for dict should have been set") });
        assert_eq!(e.unwrap_err(), "decoder for dict should have been set");
        let n = 3;
        let e = guarded(|| -> u8 { panic!("bad offset {n}") });
        assert_eq!(e.unwrap_err(), "bad offset 3");
        assert!(!GUARDED.with(Cell::get));
    }

    #[tokio::test]
    async fn a_future_that_panics_after_waiting_ends_with_the_message() {
        let fut = async {
            tokio::task::yield_now().await;
            if GUARDED.with(Cell::get) {
                panic!("mid-stream");
            }
            1
        };
        assert_eq!(guarded_async(fut).await.unwrap_err(), "mid-stream");
        assert_eq!(guarded_async(async { 2 }).await, Ok(2));
    }

    #[tokio::test]
    async fn a_stream_that_panics_ends_with_the_message() {
        use futures::StreamExt;
        let items = futures::stream::iter([1, 2, 3]).map(|i| {
            assert!(i < 3, "item {i}");
            i
        });
        let got: Vec<_> = guarded_stream(items).collect().await;
        assert_eq!(got, vec![Ok(1), Ok(2), Err("item 3".to_string())]);
    }
}
